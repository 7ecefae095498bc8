"""Gated SiLU MLP (Llama's gate/up/down)."""

import jax
from flax import nnx


class GatedMLP(nnx.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs):
        def proj(eq, shape):
            return nnx.Einsum(eq, shape, dtype=dtype, param_dtype=dtype, rngs=rngs)

        self.gate_proj = proj("td,df->tf", (hidden_size, intermediate_size))
        self.up_proj = proj("td,df->tf", (hidden_size, intermediate_size))
        self.down_proj = proj("tf,fd->td", (intermediate_size, hidden_size))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [T, D] -> [T, D]."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
