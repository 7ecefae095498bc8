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
