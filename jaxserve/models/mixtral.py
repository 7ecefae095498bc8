"""Mixtral (MixtralForCausalLM): the Llama family's attention with a mixture-of-experts MLP
in every layer (layers/fused_moe.py). Only the weight mapping is its own: the router
`block_sparse_moe.gate` and each expert's w1 (gate), w3 (up) and w2 (down), stacked into the
FusedMoE's [E, ...] arrays (models/weight_maps.py::routed_experts); Qwen3-MoE
(models/qwen3_moe.py) differs only in those names."""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.weight_maps import compose, routed_experts


class MixtralForCausalLM(LlamaForCausalLM):
    hf_weight = compose(routed_experts("block_sparse_moe", ("w1", "w3", "w2")))
