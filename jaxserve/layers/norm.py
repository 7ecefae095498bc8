"""RMSNorm."""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32 (a weightless RMSNorm: Llama 4's q/k norm)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """y = weight * x / rms(x), the normalisation computed in float32 (as HF Llama does)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def normalized(self, x: jax.Array) -> jax.Array:
        """x / rms(x) in float32."""
        return rms_normalize(x, self.eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in x's dtype."""
        return self.weight[...] * self.normalized(x).astype(x.dtype)

    def split(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The norm as (weight * x in x's dtype, f32[...] 1 / rms(x)): their product is the
        norm, and a linear map without bias may take the first and scale its output rows by
        the second (the scaling then joins whatever reads the output, no pass of its own)."""
        x32 = x.astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + self.eps)
        return self.weight[...] * x, scale


def scale_rows(y: jax.Array, row_scale: jax.Array | None) -> jax.Array:
    """y [T, N] with each row times row_scale f32[T] (RMSNorm.split's), in y's dtype (None:
    y)."""
    return y if row_scale is None else (y * row_scale[:, None]).astype(y.dtype)


class HeadsRMSNorm(nnx.Module):
    """RMSNorm over a whole projection laid out as heads: x [..., H, hd] normalised over its
    last two axes together, times weight [H, hd] (MiniMax-M2's q / k norms). Under tensor
    parallelism the heads are split, and the mean over them is summed across devices."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((num_heads, head_dim), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=(-2, -1), keepdims=True)
        return self.weight[...] * (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
