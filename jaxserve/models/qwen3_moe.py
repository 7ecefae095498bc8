"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms) with Mixtral's experts
under other names (`mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`); the layers in
`mlp_only_layers` (or off `decoder_sparse_step`) keep a dense MLP (ModelConfig.dense_layers)."""

from jaxserve.models.mixtral import MixtralForCausalLM


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    moe_module = "mlp"
    expert_names = ("gate_proj", "up_proj", "down_proj")
