"""RMSNorm."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """y = weight * x / rms(x), the normalisation computed in float32 (as HF Llama does)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def normalized(self, x: jax.Array) -> jax.Array:
        """x / rms(x) in float32."""
        xf = x.astype(jnp.float32)
        return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in x's dtype."""
        return self.weight[...] * self.normalized(x).astype(x.dtype)
