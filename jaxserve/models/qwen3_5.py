"""Qwen3.5 (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; the published
...ForConditionalGeneration checkpoints, with images, are models/vlm.py's): Qwen3-Next's layout
(models/qwen3_next.py: 3 gated delta-net layers to 1 gated-attention layer, zero-centred
norms, a gated shared expert beside 256 routed ones in the MoE build), with the linear
attention's projections stored apart: `in_proj_qkv` [2 Hk Dk + Hv Dv, D], `in_proj_z`
[Hv Dv, D], `in_proj_b` and `in_proj_a` [Hv, D], where Qwen3-Next stores them fused and
grouped per key head. They are regrouped as they load into the same GatedDeltaNet.

Its rotary embedding is interleaved M-RoPE (mrope_section [11, 11, 10] over the rotary
quarter of each head): for text every axis takes the token's position, which is the plain
partial rotary."""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import HFWeight
from jaxserve.models.qwen3_next import Qwen3NextForCausalLM


def _split_linear_attention(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
    """The fused projections GatedDeltaNet keeps (per key head h: q_h, k_h, then its r value
    heads' v and z; and its r heads' b, then a), from Qwen3.5's separate ones."""
    if names[0] != "layers" or names[2] != "linear_attn" or names[-1] != "kernel":
        return None
    if names[3] not in ("in_proj_qkvz", "in_proj_ba"):
        return None
    c = config.linear_attn
    prefix = f"model.layers.{names[1]}.linear_attn"
    hk = c.num_k_heads

    def grouped(*weights: np.ndarray) -> np.ndarray:
        """[H_i * w_i, D] each (heads in order: key head h's value heads are h r .. h r + r
        - 1) -> [D, sum of the widths] grouped per key head."""
        parts = [w.reshape(hk, -1, w.shape[-1]) for w in weights]
        return np.concatenate(parts, axis=1).reshape(-1, weights[0].shape[-1]).T

    if names[3] == "in_proj_qkvz":

        def build(qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
            q, k, v = np.split(qkv, [hk * c.k_head_dim, 2 * hk * c.k_head_dim])
            return grouped(q, k, v, z)

        return HFWeight((f"{prefix}.in_proj_qkv.weight", f"{prefix}.in_proj_z.weight"), build)

    names_ba = (f"{prefix}.in_proj_b.weight", f"{prefix}.in_proj_a.weight")  # [Hv, D] each
    return HFWeight(names_ba, grouped)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    @classmethod
    def hf_weight(cls, config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        names = tuple(str(p) for p in path)
        weight = _split_linear_attention(config, names, kv_replicas)
        if weight is None:
            weight = Qwen3NextForCausalLM.hf_weight(config, path, kv_replicas)
        return weight
