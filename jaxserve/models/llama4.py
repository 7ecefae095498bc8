"""Llama 4's text model (Llama4ForCausalLM): Llama's decoder with chunked local attention and
weightless q/k norms on the rotary layers, global attention with temperature-tuned queries on
the layers without rotary, and top-1 sigmoid-routed experts with a shared expert on the MoE
layers (config/llama4.py reads which is which; layers/attention.py and layers/fused_moe.py run
them). Only the weight mapping is this module's:

- HF's `feed_forward` is the layer's `mlp`: the router `feed_forward.router`, the experts'
  `gate_up_proj` [E, D, 2F] (gate then up, re-laid interleaved as w13) and `down_proj`
  [E, F, D], the shared expert's and the dense layers' gate/up/down projections.
- Llama 4 rotates interleaved pairs of each head's dims (HF multiplies by complex numbers);
  the q and k rows of each head are permuted at load into rotate-half's layout (even dims,
  then odd), which leaves every q . k, and so the attention, unchanged.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import HFWeight, LlamaForCausalLM, fuse_gate_up, fuse_qkv


def rotate_half_order(w: np.ndarray, head_dim: int) -> np.ndarray:
    """HF q or k rows [H * hd, ...] with each head's interleaved pairs (2i, 2i + 1) moved to
    rotate-half's (i, i + hd / 2)."""
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return heads[:, order].reshape(w.shape)


class Llama4ForCausalLM(LlamaForCausalLM):
    eagle_target = False  # (its chunked local attention: untested with a head)

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        names = [str(p) for p in path]
        if names[0] != "layers":
            return LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        prefix = f"model.layers.{names[1]}"
        if names[2:4] == ["self_attn", "qkv_proj"]:
            qkv = tuple(f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv")
            hd = config.head_dim

            def build(q, k, v):
                q, k = rotate_half_order(q, hd), rotate_half_order(k, hd)
                return fuse_qkv(q, k, v, config=config, kv_replicas=kv_replicas).T

            return HFWeight(qkv, build)
        if names[2] != "mlp":
            return LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        ff = f"{prefix}.feed_forward"
        leaf = names[3]
        if leaf == "gate":  # the router [E, D] -> [D, E]
            return HFWeight((f"{ff}.router.weight",), np.transpose)
        if leaf == "w13":  # [E, D, 2F] gate then up -> interleaved
            return HFWeight((f"{ff}.experts.gate_up_proj",), _interleave_gate_up)
        if leaf == "w2":
            return HFWeight((f"{ff}.experts.down_proj",))
        mlp = f"{ff}.shared_expert" if leaf == "shared_experts" else ff
        proj = names[-2]
        if proj == "gate_up_proj":
            return HFWeight(
                (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                lambda gate, up: fuse_gate_up(gate, up).T,
            )
        return HFWeight((f"{mlp}.down_proj.weight",), np.transpose)


def _interleave_gate_up(w: np.ndarray) -> np.ndarray:
    """[E, D, 2F] gate columns then up columns -> column 2f gate f, 2f + 1 up f."""
    gate, up = np.split(w, 2, axis=-1)
    return np.stack([gate, up], axis=-1).reshape(w.shape)


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """Llama 4's multimodal checkpoints (Scout, Maverick) served as their text model: the
    same weights under `language_model.` (the vision tower and projector are not read)."""

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        weight = Llama4ForCausalLM.hf_weight(config, path, kv_replicas)
        return HFWeight(tuple(f"language_model.{n}" for n in weight.names), weight.build)
