"""MiniMax-M2 (MiniMaxM2ForCausalLM): the Llama family's grouped-query attention with partial
rotary (its `partial_rotary_factor`) and q / k RMSNorms over each whole projection, not per
head (layers/norm.py::HeadsRMSNorm: under tensor parallelism the mean over the split heads is
summed across devices); a mixture of experts in every layer, Mixtral's names
(`block_sparse_moe`, w1 / w3 / w2), routed as DeepSeek-V3 routes without groups or shared
experts: sigmoid scores, the top-k picked by score + `e_score_correction_bias`, weighted by
their scores renormalised (config/moe.py)."""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import HFWeight, LlamaForCausalLM
from jaxserve.models.weight_maps import compose, routed_experts


def _norms_and_bias(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
    """The q / k norms [H * hd] as [H, hd] (k's heads repeated as the cache holds them) and
    the routing bias, which sits on the MoE block."""
    if names[0] != "layers":
        return None
    prefix = f"model.layers.{names[1]}"
    if names[2:4] == ("mlp", "e_score_correction_bias"):
        return HFWeight((f"{prefix}.block_sparse_moe.e_score_correction_bias",))
    if names[2] != "self_attn" or names[3] not in ("q_norm", "k_norm"):
        return None
    hd, repeat = config.head_dim, kv_replicas if names[3] == "k_norm" else 1
    return HFWeight(
        (f"{prefix}.self_attn.{names[3]}.weight",),
        lambda w: np.repeat(w.reshape(-1, hd), repeat, axis=0),
    )


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    hf_weight = compose(_norms_and_bias, routed_experts("block_sparse_moe", ("w1", "w3", "w2")))
