"""A plain dense layer with its kernel stored [in, out], optionally weight-only quantized."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxserve.config import GROUPED_QUANT
from jaxserve.layers.lora import LoRABatch, LoRAWeights
from pallas_kernels.grouped_matmul import channel_matmul, packed_matmul
from pallas_kernels.grouped_matmul.packed import E2M1

# Quantized kernel dtypes and the largest value each holds.
QUANT_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
GGUF_BLOCK = 16  # input rows per scale and min of a "gguf" kernel (Q6_K's sub-blocks)
__all__ = ["E2M1", "Linear", "fake_quantize_input", "quantize_kernel"]


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out]: the layout a matmul reads as it is, so no
    weight is transposed or copied in the step.

    quant "int8" / "fp8": kernel holds int8 or float8_e4m3 values and `scale` f32[out] one
    scale per output channel (`quantize_kernel`); the product is (x @ kernel) * scale, the
    kernel converted to x's dtype inside the matmul's fusion.

    quant "fp8_block": float8_e4m3 values and `scale` f32[in / group, out], one scale per
    `group` input rows of each output channel (a checkpoint's 2-D block scales, each block's
    scale repeated over its output channels: models/loader.py); the weight is q * scale
    groupwise, rebuilt in x's dtype for the matmul.

    quant "int4": 4-bit weights packed two a byte, kernel uint8 [in / 2, out] (row 2i in the
    low nibble, 2i + 1 in the high one), `scale` and `offset` f32[in / group, out]; the
    weight is u * scale + offset groupwise (u the unsigned nibble: offset = -zero_point *
    scale), unpacked in x's dtype for the matmul. compressed-tensors' pack-quantized W4A16,
    GPTQ and AWQ (models/int4_checkpoints.py). Act-order GPTQ adds `perm` int32 [in]: the
    kernel's row r is input perm[r] (rows sorted by group), so x is gathered by it first.

    quant "mxfp4": OCP MX FP4, kernel uint8 [in / 2, out] of e2m1 codes packed as int4's,
    `scale` uint8 [in / group, out] of e8m0 exponents (2 ** (e - 127)), group 32;
    compressed-tensors' mxfp4-pack-quantized (llm-compressor's MXFP4A16).

    quant "gguf": a GGUF file's blocks kept quantized (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q6_K;
    models/weight_sources.py::gguf_blocks): kernel holds int8 q [in, out], `scale` d and
    `offset` m f32[in / 16, out], one per 16 input rows; the weight is d * q + m blockwise,
    rebuilt in x's dtype for the matmul.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        bias: bool = False,
        dtype,
        rngs: nnx.Rngs,
        quant: str | None = None,
        group: int = 0,
        act_order: bool = False,
        input_quant: str | None = None,
        input_group: int = 0,
    ):
        """group: input rows per scale of an "fp8_block" or "int4" kernel; act_order: an
        "int4" kernel whose input rows are stored in `perm` order (act-order GPTQ);
        input_quant, input_group: x quantized and dequantized first (`fake_quantize_input`)."""
        self.input_quant, self.input_group = input_quant, input_group
        init = nnx.initializers.lecun_normal()
        self.group = 0 if quant not in GROUPED_QUANT else GGUF_BLOCK if quant == "gguf" else group
        if quant is None:
            self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), dtype))
            self.scale = self.offset = None
        elif quant in GROUPED_QUANT:
            if self.group < 1 or d_in % self.group:
                raise ValueError(
                    f"a {quant} kernel's input size {d_in} is not a multiple of its group "
                    f"{self.group}"
                )
            kind = {"gguf": jnp.int8, "fp8_block": jnp.float8_e4m3fn}.get(quant, jnp.uint8)
            rows = d_in // 2 if quant in ("int4", "mxfp4") else d_in  # two 4-bit values a byte
            self.kernel = nnx.Param(jnp.zeros((rows, d_out), kind))
            self.scale = nnx.Param(
                jnp.full((d_in // self.group, d_out), 127, jnp.uint8)  # e8m0: 2 ** (e - 127)
                if quant == "mxfp4"
                else jnp.ones((d_in // self.group, d_out), jnp.float32)
            )
            self.offset = (
                nnx.Param(jnp.zeros((d_in // self.group, d_out), jnp.float32))
                if quant in ("gguf", "int4")
                else None
            )
        else:
            self.kernel = nnx.Param(jnp.zeros((d_in, d_out), QUANT_DTYPES[quant][0]))
            self.scale = nnx.Param(jnp.ones((d_out,), jnp.float32))
            self.offset = None
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        act_order = act_order and quant == "int4"
        self.perm = nnx.Param(jnp.arange(d_in, dtype=jnp.int32)) if act_order else None
        self.lora: LoRAWeights | None = None  # --enable-lora's slots (worker/lora_slots.py)

    def __call__(self, x: jax.Array, lora: LoRABatch | None = None) -> jax.Array:
        """x: [T, in] -> [T, out]; lora: each token's adapter slot, when this projection
        has slots (the adapter reads x as it came, before act-order or input quantization)."""
        y = self._base(x)
        if lora is not None and self.lora is not None:
            y = self.lora(x, y, lora)
        return y

    def _base(self, x: jax.Array) -> jax.Array:
        if self.perm is not None:  # the kernel's rows are the inputs in perm's order
            x = jnp.take(x, self.perm[...], axis=-1)
        if self.input_quant is not None:
            x = fake_quantize_input(x, self.input_quant, self.input_group)
        if self.scale is None:
            y = x @ self.kernel[...]
        elif self.group:  # grouped scales: gguf, fp8_block, int4, mxfp4
            offset = None if self.offset is None else self.offset[...]
            # W8A8's emulated inputs keep XLA's dot: a 1-ulp change in a product can flip the
            # next projection's dynamic fp8 rounding by a whole e4m3 step. With the CPU
            # kernel's summation order one value of ct-fp8-block's layer-0 down_proj input
            # (prompt 1, position 2) rounded to 2.75, not compressed-tensors' 2.5: 3% logits
            # from there on (issue 67)
            y = packed_matmul(
                x,
                self.kernel[...],
                self.scale[...],
                offset,
                self.group,
                native=self.input_quant is None,
            )
        elif self.input_quant is None:  # per-channel int8 / fp8: the CPU kernel where it runs
            y = channel_matmul(x, self.kernel[...], self.scale[...])
        else:
            y = (x @ self.kernel[...].astype(x.dtype)) * self.scale[...].astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


def fake_quantize_input(x: jax.Array, kind: str, group: int) -> jax.Array:
    """Dynamic symmetric quantization of x [T, in] and back, in x's dtype, as
    compressed-tensors applies a W8A8 checkpoint's input_activations: per token (group 0) or
    per `group` inputs of each token, scale = max |x| / (the format's range / 2), x / scale
    clamped to the range and rounded (to e4m3 for "fp8", to an integer for "int8")."""
    t, d_in = x.shape
    g = x.reshape(t, -1, group or d_in)
    lo, hi = (-448.0, 448.0) if kind == "fp8" else (-128.0, 127.0)
    scale = jnp.max(jnp.abs(g), axis=-1, keepdims=True) / ((hi - lo) / 2)
    scale = jnp.where(scale == 0, jnp.finfo(x.dtype).eps, scale)
    q = jnp.clip(g / scale, lo, hi)
    q = q.astype(jnp.float8_e4m3fn).astype(x.dtype) if kind == "fp8" else jnp.round(q)
    return (q * scale).reshape(t, d_in)


def quantize_kernel(w: np.ndarray, quant: str) -> tuple[np.ndarray, np.ndarray]:
    """A float kernel [in, out] -> (quantized [in, out], f32 scale [out]): symmetric, one
    scale per output channel (its largest magnitude maps to the format's largest value)."""
    dtype, top = QUANT_DTYPES[quant]
    w = np.asarray(w, np.float32)
    scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / top  # [out]
    q = w / scale
    if quant == "int8":
        q = np.clip(np.rint(q), -top, top).astype(np.int8)
    else:
        q = q.astype(ml_dtypes.float8_e4m3fn)
    return q, scale.astype(np.float32)
