"""A plain dense layer with its kernel stored [in, out]."""

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out]: the layout a matmul reads as it is, so no
    weight is transposed or copied in the step."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [T, in] -> [T, out]."""
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]
