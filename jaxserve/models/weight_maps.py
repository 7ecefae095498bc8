"""A family's HF tensor names, composed from small maps instead of inherited: each map takes
(config, the parameter's path as strings, kv_replicas) and returns the HFWeight it knows for
that path, or None; `compose` makes a family's `hf_weight` that tries its maps in order and
falls back to the Llama layout's (models/llama.py). A family thus names the blocks it is made
of (MLA attention, routed experts under some names, DeepSeek's shared experts) and inherits
only LlamaForCausalLM."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import HFWeight, LlamaForCausalLM, fuse_gate_up

WeightMap = Callable[[ModelConfig, tuple[str, ...], int], HFWeight | None]

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def compose(*maps: WeightMap) -> classmethod:
    """A family's `hf_weight` classmethod: the first of `maps` that knows the path, else
    LlamaForCausalLM's."""

    def hf_weight(cls, config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        names = tuple(str(p) for p in path)
        for weight_map in maps:
            weight = weight_map(config, names, kv_replicas)
            if weight is not None:
                return weight
        return LlamaForCausalLM.hf_weight(config, path, kv_replicas)

    return classmethod(hf_weight)


def _moe_mlp(config: ModelConfig, names: tuple[str, ...]) -> bool:
    return names[0] == "layers" and names[2] == "mlp" and config.is_moe_layer(int(names[1]))


def routed_experts(moe_module: str, expert_names: tuple[str, str, str]) -> WeightMap:
    """Mixtral-style experts: the router `{moe_module}.gate` and each expert's gate, up and
    down projections (`expert_names`), stacked into FusedMoE's [E, ...] arrays."""

    def weight(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
        if not _moe_mlp(config, names):
            return None
        prefix = f"model.layers.{names[1]}.{moe_module}"
        experts = range(config.num_experts)
        gate, up, down = (
            tuple(f"{prefix}.experts.{e}.{n}.weight" for e in experts) for n in expert_names
        )
        if names[3] == "gate":  # the router [E, D] -> [D, E]
            return HFWeight((f"{prefix}.gate.weight",), np.transpose)
        if names[3] == "w13":  # per expert gate, up [F, D] -> [E, D, 2F], interleaved
            e = config.num_experts
            return HFWeight(
                gate + up, lambda *w: np.stack([fuse_gate_up(w[i], w[e + i]).T for i in experts])
            )
        return HFWeight(down, lambda *w: np.stack([x.T for x in w]))  # [D, F] -> [E, F, D]

    return weight


def fused_experts(moe_module: str) -> WeightMap:
    """Experts stored fused, as Qwen3-VL-MoE's checkpoints hold them: the router
    `{moe_module}.gate`, `experts.gate_up_proj` [E, D, 2F] (every gate column, then every up
    column) and `experts.down_proj` [E, F, D]; or each with its last two axes swapped, as
    transformers keeps them in memory (and some of its saves write them), told apart by F."""

    def weight(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
        if not _moe_mlp(config, names):
            return None
        prefix = f"model.layers.{names[1]}.{moe_module}"
        f = config.moe_intermediate_size
        if names[3] == "gate":  # the router [E, D] -> [D, E]
            return HFWeight((f"{prefix}.gate.weight",), np.transpose)
        if names[3] == "w13":  # gate then up columns -> interleaved (2f gate f, 2f + 1 up f)

            def interleave(w: np.ndarray) -> np.ndarray:
                w = w if w.shape[-1] == 2 * f else w.swapaxes(1, 2)
                gate, up = np.split(w, 2, axis=-1)
                return np.stack([gate, up], axis=-1).reshape(w.shape)

            return HFWeight((f"{prefix}.experts.gate_up_proj",), interleave)
        return HFWeight(
            (f"{prefix}.experts.down_proj",),
            lambda w: w if w.shape[1] == f else w.swapaxes(1, 2),
        )

    return weight


def shared_experts(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
    """DeepSeek-V3 / GLM-4.5's routing bias and shared experts (`mlp.shared_experts`)."""
    if not _moe_mlp(config, names):
        return None
    prefix = f"model.layers.{names[1]}.mlp"
    if names[3] == "e_score_correction_bias":
        return HFWeight((f"{prefix}.gate.e_score_correction_bias",))
    if names[3] != "shared_experts":
        return None
    shared = f"{prefix}.shared_experts"
    if names[4] == "gate_up_proj":
        return HFWeight(
            (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
            lambda gate, up: fuse_gate_up(gate, up).T,
        )
    return HFWeight((f"{shared}.down_proj.weight",), np.transpose)
