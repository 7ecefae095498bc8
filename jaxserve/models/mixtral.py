"""Mixtral (MixtralForCausalLM): the Llama family's attention with a mixture-of-experts MLP
in every layer (layers/fused_moe.py). Only the weight mapping is its own: the router
`block_sparse_moe.gate` and each expert's w1 (gate), w3 (up) and w2 (down), stacked into the
FusedMoE's [E, ...] arrays; Qwen3-MoE (models/qwen3_moe.py) differs only in those names."""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import HFWeight, LlamaForCausalLM, fuse_gate_up


class MixtralForCausalLM(LlamaForCausalLM):
    moe_module = "block_sparse_moe"  # the HF submodule holding `gate` and `experts`
    expert_names = ("w1", "w3", "w2")  # each expert's gate, up and down projections

    @classmethod
    def hf_weight(cls, config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        names = [str(p) for p in path]
        if names[0] != "layers" or names[2] != "mlp" or not config.is_moe_layer(int(names[1])):
            return LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        prefix = f"model.layers.{names[1]}.{cls.moe_module}"
        experts = range(config.num_experts)
        gate, up, down = (
            tuple(f"{prefix}.experts.{e}.{n}.weight" for e in experts) for n in cls.expert_names
        )
        if names[3] == "gate":  # the router [E, D] -> [D, E]
            return HFWeight((f"{prefix}.gate.weight",), np.transpose)
        if names[3] == "w13":  # per expert gate, up [F, D] -> [E, D, 2F], interleaved
            e = config.num_experts
            return HFWeight(
                gate + up, lambda *w: np.stack([fuse_gate_up(w[i], w[e + i]).T for i in experts])
            )
        return HFWeight(down, lambda *w: np.stack([x.T for x in w]))  # [D, F] -> [E, F, D]
