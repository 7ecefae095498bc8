"""EAGLE-1 draft head for a Llama-family target (vLLM's `EagleLlamaForCausalLM`).

The head is one (or a few) Llama decoder layers behind a projection `fc` [2D -> D] of
[embedding of token t+1 ; the target's final hidden state at t]. Its output hidden state h
gives the draft's logits through the *target's* LM head (no final norm), and is fed back as
the feature of the next draft step. The first layer has no input norm (its input is fc's
output). The token embedding is the target's, as vLLM shares it.

Checkpoints: an HF dir in EAGLE's own layout (config.json of a LlamaConfig; tensors
`fc.weight`, `layers.0.self_attn.q_proj.weight`, ... without the `model.` prefix; an
`embed_tokens.weight` there is ignored).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.linear import Linear
from jaxserve.models.llama import DecoderLayer, HFWeight, KVCaches, LlamaForCausalLM


class EagleDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, *, kv_replicas: int, rngs: nnx.Rngs):
        super().__init__(config, layer, kv_replicas=kv_replicas, rngs=rngs)
        if layer == 0:  # its input is fc's output: EAGLE drops this norm
            self.input_layernorm = None

    def __call__(self, x, positions, k_cache, v_cache, md: AttentionMetadata):
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        attn_out, k_cache, v_cache = self.self_attn(normed, positions, k_cache, v_cache, md)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class EagleLlamaForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        self.config = config
        self.kv_replicas = kv_replicas
        d = config.hidden_size
        self.fc = Linear(2 * d, d, dtype=config.dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                EagleDecoderLayer(config, i, kv_replicas=kv_replicas, rngs=rngs)
                for i in range(config.num_layers)
            ]
        )

    @property
    def num_cache_kv_heads(self) -> int:
        return self.config.num_kv_heads * self.kv_replicas

    def __call__(
        self,
        embeds: jax.Array,
        features: jax.Array,
        positions: jax.Array,
        kv_caches: KVCaches,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCaches]:
        """embeds: [T, D] the target's embeddings of tokens t+1; features: [T, D] the hidden
        state at t (the target's, or the head's own for later drafts); positions: i32[T], t
        -> (hidden [T, D], kv_caches)."""
        k_cache, v_cache = kv_caches
        num_blocks = k_cache.shape[0] // len(self.layers)
        block_size = k_cache.shape[1]
        h = self.fc(jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1))
        for i, layer in enumerate(self.layers):
            offset = i * num_blocks
            layer_md = md._replace(
                block_tables=md.block_tables + offset,
                slot_mapping=jnp.where(
                    md.slot_mapping >= 0, md.slot_mapping + offset * block_size, -1
                ),
            )
            h, k_cache, v_cache = layer(h, positions, k_cache, v_cache, layer_md)
        return h, (k_cache, v_cache)

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        """fc.weight (transposed to [2D, D]); the layers as the Llama family's, without the
        `model.` prefix."""
        if str(path[0]) == "fc":
            return HFWeight(("fc.weight",), np.transpose)
        weight = LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        return HFWeight(tuple(n.removeprefix("model.") for n in weight.names), weight.build)
