"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): Llama-style attention with partial rotary (the leading
half of each head), q/k/v biases and optional q/k norms (`use_qk_norm`); a dense MLP in the
first `first_k_dense_replace` layers and in the rest DeepSeek-V3-style experts: sigmoid
routing with a score-correction bias among expert groups, scaled, plus shared experts
(config/moe.py, layers/fused_moe.py). The checkpoint's multi-token-prediction layer (index
num_hidden_layers) is read only as speculative method mtp's draft (models/mtp.py)."""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.weight_maps import GATE_UP_DOWN, compose, routed_experts, shared_experts


class Glm4MoeForCausalLM(LlamaForCausalLM):
    hf_weight = compose(shared_experts, routed_experts("mlp", GATE_UP_DOWN))
