"""Weights kept packed in device memory and decoded where they are used (inside a matmul's
fusion, or one expert at a time inside the grouped matmul's tile loop): the grouped formats of
layers/linear.py, for a kernel [K, N] or a stack of experts [E, K, N].

  kernel: [..., K, N] float8_e4m3 ("fp8_block") or int8 ("gguf"); uint8 [..., K / 2, N] of
          two 4-bit codes a byte, row 2r in the low nibble and 2r + 1 in the high one
          ("int4": unsigned integers; "mxfp4": OCP e2m1 codes, `E2M1`)
  scale:  [..., K / group, N]: float32, or uint8 e8m0 exponents (2 ** (s - 127), "mxfp4")
  offset: [..., K / group, N] float32 or None ("int4", "gguf": w = q * scale + offset)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# OCP FP4 (e2m1): the value of each 4-bit code, the sign in bit 3
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(
    kernel: jax.Array, scale: jax.Array, offset: jax.Array | None, group: int, dtype
) -> jax.Array:
    """The module doc's packed arrays -> the weight [..., K, N] in `dtype`."""
    k = kernel
    if k.dtype == jnp.uint8:  # int4, mxfp4: the low nibble is the even row
        k = jnp.stack([k & 0xF, k >> 4], axis=-2).reshape(*k.shape[:-2], -1, k.shape[-1])
    *lead, d_in, d_out = k.shape
    if scale.dtype == jnp.uint8:  # mxfp4: e2m1 codes; e8m0 exponents -> f32 2 ** (e - 127)
        w = jnp.asarray(E2M1, dtype)[k]
        scale = jax.lax.bitcast_convert_type(scale.astype(jnp.uint32) << 23, jnp.float32)
    else:
        w = k.astype(dtype)
    w = w.reshape(*lead, d_in // group, group, d_out) * scale.astype(dtype)[..., None, :]
    if offset is not None:
        w = w + offset.astype(dtype)[..., None, :]
    return w.reshape(*lead, d_in, d_out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """A stack of expert weights [E, K, N] kept packed (the module doc's arrays)."""

    kernel: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    group: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int, int]:
        """The weights' logical shape [E, K, N]."""
        e, rows, n = self.kernel.shape
        return e, rows * 2 if self.kernel.dtype == jnp.uint8 else rows, n

    def expert(self, e: jax.Array | int, dtype) -> jax.Array:
        """Expert e's weight [K, N] in dtype (only its blocks read)."""
        offset = None if self.offset is None else self.offset[e]
        return dequantize(self.kernel[e], self.scale[e], offset, self.group, dtype)

    def dense(self, dtype) -> jax.Array:
        """Every expert's weight [E, K, N] in dtype."""
        return dequantize(self.kernel, self.scale, self.offset, self.group, dtype)

    @property
    def nbytes(self) -> int:
        leaves = (self.kernel, self.scale, self.offset)
        return sum(a.size * a.dtype.itemsize for a in leaves if a is not None)
