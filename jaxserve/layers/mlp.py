"""Gated MLP (Llama's gate/up/down; SiLU, or tanh-approximated GELU for Gemma) with one fused
gate_up projection."""

import jax
from flax import nnx

from jaxserve.layers.linear import Linear
from jaxserve.layers.lora import LoRABatch
from jaxserve.layers.norm import scale_rows


class GatedMLP(nnx.Module):
    """gate_up_proj's output columns interleave the two: column 2f is gate f, 2f + 1 is up f,
    so under tensor parallelism each device's contiguous share holds both halves of its f."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype,
        rngs: nnx.Rngs,
        act: str = "silu",
        linear: dict | None = None,
    ):
        """linear: the projections' quantization (ModelConfig.linear_kwargs)."""
        linear = linear or {}
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, dtype=dtype, rngs=rngs, **linear
        )
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, rngs=rngs, **linear)
        self.act = act

    def __call__(
        self, x: jax.Array, lora: LoRABatch | None = None, row_scale: jax.Array | None = None
    ) -> jax.Array:
        """x: [T, D] -> [T, D]; lora: the tokens' adapter slots (layers/lora.py); row_scale:
        f32[T] or None, x's rows times it (RMSNorm.split), applied to gate_up_proj's output."""
        gate_up = scale_rows(self.gate_up_proj(x, lora), row_scale)
        gate_up = gate_up.reshape(x.shape[0], -1, 2)  # [T, F, 2]
        gate = gate_up[..., 0]
        if self.act == "gelu_pytorch_tanh":
            gate = jax.nn.gelu(gate, approximate=True)
        else:
            gate = jax.nn.silu(gate)
        return self.down_proj(gate * gate_up[..., 1], lora)
