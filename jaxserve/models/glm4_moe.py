"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): Llama-style attention with partial rotary (the leading
half of each head), q/k/v biases and optional q/k norms (`use_qk_norm`); a dense MLP in the
first `first_k_dense_replace` layers and in the rest DeepSeek-V3-style experts: sigmoid
routing with a score-correction bias among expert groups, scaled, plus shared experts
(config/moe.py, layers/fused_moe.py). The checkpoint's multi-token-prediction layer (index
num_hidden_layers) is not read."""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import HFWeight, fuse_gate_up
from jaxserve.models.mixtral import MixtralForCausalLM


class Glm4MoeForCausalLM(MixtralForCausalLM):
    moe_module = "mlp"
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def hf_weight(cls, config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        names = [str(p) for p in path]
        if names[0] == "layers" and names[2] == "mlp" and config.is_moe_layer(int(names[1])):
            prefix = f"model.layers.{names[1]}.mlp"
            if names[3] == "e_score_correction_bias":
                return HFWeight((f"{prefix}.gate.e_score_correction_bias",))
            if names[3] == "shared_experts":
                shared = f"{prefix}.shared_experts"
                if names[4] == "gate_up_proj":
                    return HFWeight(
                        (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
                        lambda gate, up: fuse_gate_up(gate, up).T,
                    )
                return HFWeight((f"{shared}.down_proj.weight",), np.transpose)
        return super().hf_weight(config, path, kv_replicas)
