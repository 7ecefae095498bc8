"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of gated delta-net linear attention
(layers/gated_delta_net.py) in most layers and, every `full_attention_interval`-th, full
attention with q/k norms, partial rotary and an output gate (the second half of each head's
q_proj columns: Attention.gate_proj); Qwen3-MoE's experts with a shared expert scaled by
sigmoid(shared_expert_gate). Its norms are zero-centred (x / rms(x) * (1 + w), as Gemma's).
The checkpoint's multi-token-prediction weights (`mtp.*`) are not read.

The caches are (K, V, conv, rec): K and V [L_kv * num_blocks, block_size, Hkv, hd] for the
full-attention layers only (the l-th of them at rows l * num_blocks + block), and the linear
layers' states, tuples of one array per layer: conv [N, K-1, C] and rec f32[N, Hv, Dk, Dv],
one slot per input-batch row (worker/kv_cache.py)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import Attention
from jaxserve.layers.fused_moe import FusedMoE
from jaxserve.layers.gated_delta_net import GatedDeltaNet
from jaxserve.layers.mlp import GatedMLP
from jaxserve.models.gemma import GemmaRMSNorm
from jaxserve.models.llama import HFWeight, LlamaForCausalLM, fuse_gate_up, with_images
from jaxserve.models.step_inputs import StepInputs
from jaxserve.models.weight_maps import GATE_UP_DOWN, compose, routed_experts


class Qwen3NextDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, kv_replicas: int, rngs: nnx.Rngs):
        d, eps, dt = config.hidden_size, config.rms_norm_eps, config.dtype
        self.input_layernorm = GemmaRMSNorm(d, eps, dtype=dt)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps, dtype=dt)
        self.linear = layer in config.linear_attn.layers
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, rngs=rngs)
        else:
            self.self_attn = Attention(
                config, layer=layer, kv_replicas=kv_replicas, rngs=rngs, norm_cls=GemmaRMSNorm
            )
        if config.is_moe_layer(layer):
            self.mlp = FusedMoE(config, rngs=rngs)
        else:
            self.mlp = GatedMLP(
                d,
                config.intermediate_size,
                dtype=dt,
                rngs=rngs,
                act=config.hidden_act,
                linear=config.linear_kwargs(),
            )


def _linear_attention_layers(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
    """Qwen3-Next's gated delta-net, gated attention and single shared expert."""
    if names[0] != "layers":
        return None
    prefix = f"model.layers.{names[1]}"
    suffix = "bias" if names[-1] == "bias" else "weight"
    if names[2] == "linear_attn":
        name = f"{prefix}.linear_attn.{names[3]}"
        if names[3] == "conv1d":  # [C, 1, K] -> [K, C], the channels grouped per key head
            order = conv_channels_per_key_head(config)
            return HFWeight((f"{name}.weight",), lambda w: w[order, 0].T)
        if names[3] in ("dt_bias", "A_log"):
            return HFWeight((name,))
        if names[-1] == "kernel":
            return HFWeight((f"{name}.weight",), np.transpose)
        return HFWeight((f"{name}.weight",))  # the gated norm
    hd, heads = config.head_dim, config.num_heads
    if names[2:4] == ("self_attn", "gate_proj"):  # q_proj's per-head second halves
        return HFWeight(
            (f"{prefix}.self_attn.q_proj.weight",), lambda w: _q_half(w, heads, hd, 1).T
        )
    if names[2:4] == ("self_attn", "qkv_proj"):
        inner = LlamaForCausalLM.hf_weight(config, names, kv_replicas)
        return HFWeight(inner.names, lambda q, k, v: inner.build(_q_half(q, heads, hd, 0), k, v))
    if names[2] == "mlp" and len(names) > 4 and names[3] == "shared_experts":
        shared = f"{prefix}.mlp.shared_expert"
        if names[4] == "gate_up_proj":
            return HFWeight(
                (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
                lambda gate, up: fuse_gate_up(gate, up).T,
            )
        return HFWeight((f"{shared}.down_proj.weight",), np.transpose)
    if names[2:4] == ("mlp", "shared_expert_gate"):
        return HFWeight((f"{prefix}.mlp.shared_expert_gate.{suffix}",), np.transpose)
    return None


class Qwen3NextForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3NextDecoderLayer
    eagle_target = False  # its own forward has no aux_layers (and a state per request)
    norm_cls = GemmaRMSNorm

    def __call__(
        self,
        inputs: StepInputs,
        kv_caches,
        aux_layers: tuple[int, ...] = (),
        final_norm: bool = True,
    ):
        """inputs (models/step_inputs.py): of its fields input_ids, positions and token_rows
        (each token's state slot), i32[T], and a multimodal model's mm_rows, mm_embeds and
        mrope_positions (its attention layers' rotary positions) -> (final hidden states
        [T, D], caches with this step's K/V and states written). No EAGLE-3 features
        (speculative decoding is refused for hybrid models), no pipeline stages (refused
        too)."""
        positions, md, token_rows = inputs.positions, inputs.attn, inputs.token_rows
        k_cache, v_cache, conv, rec = kv_caches
        h = with_images(self.embed_tokens(inputs.input_ids), inputs)  # (Qwen3.5's images)
        rope_positions = positions if inputs.mrope_positions is None else inputs.mrope_positions
        kv_index = lin_index = 0
        for layer in self.layers:
            x = layer.input_layernorm(h)
            if layer.linear:
                out, conv_l, rec_l = layer.linear_attn(
                    x, positions, token_rows, md, conv[lin_index], rec[lin_index]
                )
                i = lin_index
                conv, rec = (*conv[:i], conv_l, *conv[i + 1 :]), (*rec[:i], rec_l, *rec[i + 1 :])
                lin_index += 1
            else:
                layer_md = md.at_layer(kv_index, k_cache, len(self.config.kv_layers))
                out, k_cache, v_cache = layer.self_attn(
                    x, rope_positions, k_cache, v_cache, layer_md
                )
                kv_index += 1
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h), (k_cache, v_cache, conv, rec)

    hf_weight = compose(_linear_attention_layers, routed_experts("mlp", GATE_UP_DOWN))


def conv_channels_per_key_head(config: ModelConfig) -> np.ndarray:
    """HF's convolution channels (all heads' q, then k, then v) in GatedDeltaNet's order:
    each key head's q, k and the v of its value heads."""
    c = config.linear_attn
    hk, dk = c.num_k_heads, c.k_head_dim
    q = np.arange(hk * dk).reshape(hk, dk)
    v = 2 * hk * dk + np.arange(c.num_v_heads * c.v_head_dim).reshape(hk, -1)
    return np.concatenate([q, q + hk * dk, v], axis=1).reshape(-1)


def _q_half(w: np.ndarray, heads: int, head_dim: int, half: int) -> np.ndarray:
    """Qwen3-Next's q_proj weight [H * 2 hd, D] (each head's query, then its gate) -> the
    query (half 0) or gate (half 1) rows of every head, [H * hd, D]."""
    return w.reshape(heads, 2, head_dim, *w.shape[1:])[:, half].reshape(-1, *w.shape[1:])
