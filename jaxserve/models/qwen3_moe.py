"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms) with Mixtral's experts
under other names (`mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`); the layers in
`mlp_only_layers` (or off `decoder_sparse_step`) keep a dense MLP (ModelConfig.dense_layers)."""

from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.weight_maps import GATE_UP_DOWN, compose, routed_experts


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    hf_weight = compose(routed_experts("mlp", GATE_UP_DOWN))
