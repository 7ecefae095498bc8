"""Linear-attention layers (Qwen3-Next's gated delta-net), read from the HF config: which
layers have them, and their heads. Such a model is hybrid: its full-attention layers keep
paged KV blocks, its linear-attention layers a fixed state per request (the causal
convolution's last inputs and the delta rule's [Hv, Dk, Dv] matrix: worker/kv_cache.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

# Architectures with gated delta-net layers.
GATED_DELTA_NET = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    layers: tuple[int, ...]  # the decoder layers with linear attention
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each key head serves that many value heads
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # the causal depthwise convolution's width over q, k and v

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k (num_k_heads x k_head_dim each), v."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


def linear_attention_config(hf_config: Any, architecture: str) -> LinearAttentionConfig | None:
    if architecture not in GATED_DELTA_NET:
        return None
    types = list(hf_config.layer_types)[: hf_config.num_hidden_layers]  # fewer: overrides
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported for {architecture}")
    k_heads, v_heads = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
    if v_heads % k_heads:
        raise ValueError(
            f"linear_num_value_heads={v_heads} is not a multiple of linear_num_key_heads={k_heads}"
        )
    return LinearAttentionConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_k_heads=k_heads,
        num_v_heads=v_heads,
        k_head_dim=int(hf_config.linear_key_head_dim),
        v_head_dim=int(hf_config.linear_value_head_dim),
        conv_kernel=int(hf_config.linear_conv_kernel_dim),
    )
