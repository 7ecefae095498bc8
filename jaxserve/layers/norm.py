"""RMSNorm."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """y = weight * x / rms(x), the normalisation computed in float32 (as HF Llama does)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in x's dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)
