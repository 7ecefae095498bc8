"""Phi-3 (Phi3ForCausalLM): the Llama family's layers, with HF checkpoints that already fuse
q/k/v into `qkv_proj` ([q heads | k heads | v heads] rows) and gate/up into `gate_up_proj`
([gate | up] rows). Only the weight mapping differs: each fused tensor is split and re-fused
in the Llama family's layout (per-KV-head groups, interleaved gate/up)."""

from __future__ import annotations

import functools

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import HFWeight, LlamaForCausalLM, fuse_gate_up, fuse_qkv


class Phi3ForCausalLM(LlamaForCausalLM):
    eagle_target = False  # (no EAGLE heads are published for it: untested)

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        *modules, _ = (str(p) for p in path)
        name = ".".join(modules[2:]) if modules[0] == "layers" else ""
        prefix = f"model.layers.{modules[1]}" if modules[0] == "layers" else ""
        if name == "self_attn.qkv_proj":
            split = functools.partial(_split_qkv, config=config, kv_replicas=kv_replicas)
            return HFWeight((f"{prefix}.self_attn.qkv_proj.weight",), split)
        if name == "mlp.gate_up_proj":
            return HFWeight((f"{prefix}.mlp.gate_up_proj.weight",), _split_gate_up)
        return LlamaForCausalLM.hf_weight(config, path, kv_replicas)


def _split_qkv(qkv: np.ndarray, *, config: ModelConfig, kv_replicas: int) -> np.ndarray:
    """HF's fused [(Hq + 2 Hkv) * hd, D] -> our qkv kernel [D, Hkv*R*(G+2)*hd]."""
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    q, k, v = np.split(qkv, [q_rows, q_rows + kv_rows])
    return fuse_qkv(q, k, v, config=config, kv_replicas=kv_replicas).T


def _split_gate_up(gate_up: np.ndarray) -> np.ndarray:
    """HF's fused [2F, D] (gate rows, then up rows) -> our gate_up kernel [D, 2F]."""
    gate, up = np.split(gate_up, 2)
    return fuse_gate_up(gate, up).T
