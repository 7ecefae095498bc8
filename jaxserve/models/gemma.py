"""Gemma 2 and Gemma 3 (text) on the Llama family's runner: the same fused attention and MLP
and the same paged cache, with Gemma's differences --

  - RMSNorm scales by (1 + weight), in float32 before the cast back;
  - four norms per layer: before and after attention, before and after the MLP ("sandwich");
  - embeddings times sqrt(hidden_size), tied LM head;
  - tanh-approximated GELU in the MLP (ModelConfig.hidden_act);
  - per-layer sliding windows (ModelConfig.layer_types), scores scaled by
    query_pre_attn_scalar ** -0.5, attention and final-logit soft-capping (Gemma 2);
  - q/k norms and a separate rotary base for sliding layers (Gemma 3, ModelConfig.qk_norm and
    sliding_rope).
The HF tensor names are Llama's plus the extra norms, so the weight mapping is inherited.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import Attention, AttentionMetadata
from jaxserve.layers.mlp import GatedMLP
from jaxserve.layers.norm import RMSNorm
from jaxserve.models.llama import LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """y = (x / rms(x)) * (1 + weight), computed in float32 and cast back (HF Gemma)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in x's dtype."""
        scale = 1.0 + self.weight[...].astype(jnp.float32)
        return (self.normalized(x) * scale).astype(x.dtype)


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, kv_replicas: int, rngs: nnx.Rngs):
        d, eps, dt = config.hidden_size, config.rms_norm_eps, config.dtype
        self.input_layernorm = GemmaRMSNorm(d, eps, dtype=dt)
        self.self_attn = Attention(
            config, layer=layer, kv_replicas=kv_replicas, rngs=rngs, norm_cls=GemmaRMSNorm
        )
        self.post_attention_layernorm = GemmaRMSNorm(d, eps, dtype=dt)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps, dtype=dt)
        self.mlp = GatedMLP(
            d,
            config.intermediate_size,
            dtype=dt,
            rngs=rngs,
            act=config.hidden_act,
            linear=config.linear_kwargs(),
        )
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps, dtype=dt)

    def __call__(self, x, positions, k_cache, v_cache, md: AttentionMetadata):
        """x: [T, D] -> ([T, D], k_cache, v_cache)."""
        attn_out, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), positions, k_cache, v_cache, md
        )
        x = x + self.post_attention_layernorm(attn_out)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, k_cache, v_cache


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (their config says which parts apply)."""

    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    embed_scale = True
    eagle_target = False  # (no EAGLE heads are published for it: untested)
