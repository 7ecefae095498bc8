"""EAGLE-1 draft head for a Llama-family or MoE target (vLLM's `EagleLlamaForCausalLM`).

The head is one (or a few) Llama decoder layers behind a projection `fc` [2D -> D] of
[embedding of token t+1 ; the target's final hidden state at t]. Its output hidden state h
gives the draft's logits through the *target's* LM head (no final norm), and is fed back as
the feature of the next draft step. The first layer has no input norm (its input is fc's
output). The token embedding is the target's, as vLLM shares it.

Checkpoints: an HF dir in EAGLE's own layout (config.json of a LlamaConfig; tensors
`fc.weight`, `layers.0.self_attn.q_proj.weight`, ... without the `model.` prefix; an
`embed_tokens.weight` there is ignored).

EAGLE-3 (vLLM's `Eagle3LlamaForCausalLM`): the feature is three of the target's hidden states
(the inputs of layers 2, L/2 and L-3, or the config's `eagle_aux_hidden_state_layer_ids`)
projected by `fc` [3D -> D]; its one layer (`midlayer.*`) attends over [norm(embedding) ;
hidden_norm(feature)] (a 2D-wide qkv input) with the feature as residual, then a final norm
and its own LM head over a smaller draft vocabulary, mapped to target ids by `d2t`
(target id = draft id + d2t[draft id]). Later drafts feed back its pre-norm output.

Both heads share one interface for the proposer (spec_decode/eagle.py): `prepare(features)`
maps the target's features to the head's width, `__call__(embeds, h, ...)` returns (output,
the feature of the next draft step, kv_caches), `greedy(output, ...)` the draft token ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import Attention, AttentionMetadata
from jaxserve.layers.linear import Linear
from jaxserve.layers.mlp import GatedMLP
from jaxserve.layers.norm import RMSNorm
from jaxserve.models.llama import DecoderLayer, HFWeight, KVCaches, LlamaForCausalLM, lm_logits


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


class DraftHead(nnx.Module):
    """What the proposer (spec_decode/eagle.py) calls on any draft head besides __call__:
    its cache's heads, the feature from the target's hidden states, the greedy draft."""

    config: ModelConfig
    kv_replicas: int

    @property
    def num_cache_kv_heads(self) -> int:
        return self.config.num_kv_heads * self.kv_replicas

    def prepare(self, features: jax.Array) -> jax.Array:
        """The target's final hidden states [T, D] are the feature as they are."""
        return features

    def greedy(self, out: jax.Array, lm_head: jax.Array, *, tied: bool, soft_cap) -> jax.Array:
        """The target's LM head on the output -> argmax token ids i32[T]."""
        logits = lm_logits(out, lm_head, tied=tied, soft_cap=soft_cap)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


class EagleLlamaForCausalLM(DraftHead):
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

    def __call__(
        self,
        embeds: jax.Array,
        h: jax.Array,
        positions: jax.Array,
        kv_caches: KVCaches,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array, KVCaches]:
        """embeds: [T, D] the target's embeddings of tokens t+1; h: [T, D] the feature at t
        (the target's hidden state, or the head's own output for later drafts); positions:
        i32[T], t -> (output [T, D], the same as the next feature, kv_caches)."""
        x = self.fc(jnp.concatenate([embeds, h.astype(embeds.dtype)], axis=-1))
        x, kv_caches = _run_layers(self.layers, x, positions, kv_caches, md)
        return x, x, kv_caches

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        """fc.weight (transposed to [2D, D]); the layers as the Llama family's, without the
        `model.` prefix."""
        if str(path[0]) == "fc":
            return HFWeight(("fc.weight",), np.transpose)
        weight = LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        return HFWeight(tuple(n.removeprefix("model.") for n in weight.names), weight.build)


def _run_layers(layers, x, positions, kv_caches: KVCaches, md: AttentionMetadata, *extra):
    """The head's layers over the paged cache (layer l's blocks at l * num_blocks, as the
    target's); extra: arguments before x of every layer call."""
    k_cache, v_cache = kv_caches
    for i, layer in enumerate(layers):
        layer_md = md.at_layer(i, k_cache, len(layers))
        x, k_cache, v_cache = layer(*extra, x, positions, k_cache, v_cache, layer_md)
    return x, (k_cache, v_cache)


class Eagle3DecoderLayer(nnx.Module):
    """EAGLE-3's layer: attention over [input_layernorm(embeds) ; hidden_norm(h)] (qkv 2D
    wide), the residual h (or hidden_norm(h) with norm_before_residual), then the MLP."""

    def __init__(self, config: ModelConfig, *, kv_replicas: int, rngs: nnx.Rngs):
        d, dt, eps = config.hidden_size, config.dtype, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype=dt)
        self.hidden_norm = RMSNorm(d, eps, dtype=dt)
        self.self_attn = Attention(config, layer=0, kv_replicas=kv_replicas, rngs=rngs)
        width = self.self_attn.qkv_proj.kernel.shape[1]
        self.self_attn.qkv_proj = Linear(
            2 * d, width, bias=config.attention_bias, dtype=dt, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dt)
        self.mlp = GatedMLP(d, config.intermediate_size, dtype=dt, rngs=rngs, act=config.hidden_act)
        self.norm_before_residual = bool(getattr(config.hf_config, "norm_before_residual", False))

    def __call__(self, embeds, h, positions, k_cache, v_cache, md: AttentionMetadata):
        normed = self.hidden_norm(h)
        x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        attn_out, k_cache, v_cache = self.self_attn(x, positions, k_cache, v_cache, md)
        x = (normed if self.norm_before_residual else h) + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class Eagle3LlamaForCausalLM(DraftHead):
    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        hf = config.hf_config
        if config.num_layers != 1:
            raise ValueError(
                f"an EAGLE-3 head has one decoder layer; this one has {config.num_layers}"
            )
        self.config = config
        self.kv_replicas = kv_replicas
        d, dt = config.hidden_size, config.dtype
        target_d = getattr(hf, "target_hidden_size", None) or d
        self.draft_vocab_size = getattr(hf, "draft_vocab_size", None) or config.vocab_size
        self.fc = Linear(3 * target_d, d, dtype=dt, rngs=rngs)
        self.layers = nnx.List([Eagle3DecoderLayer(config, kv_replicas=kv_replicas, rngs=rngs)])
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype=dt)
        self.draft_head = Linear(d, self.draft_vocab_size, dtype=dt, rngs=rngs)
        self.d2t = nnx.Param(jnp.zeros((self.draft_vocab_size,), jnp.int32))

    @staticmethod
    def aux_layers(head_config: ModelConfig, target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs make the feature."""
        eagle = getattr(head_config.hf_config, "eagle_config", None) or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return tuple(ids) if ids else (2, target_layers // 2, target_layers - 3)

    def prepare(self, features: jax.Array) -> jax.Array:
        """The target's three hidden states [T, 3D'] -> fc -> [T, D]."""
        return self.fc(features.astype(self.fc.kernel.dtype))

    def __call__(
        self,
        embeds: jax.Array,
        h: jax.Array,
        positions: jax.Array,
        kv_caches: KVCaches,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array, KVCaches]:
        """-> (normed output [T, D], pre-norm output (the next feature) [T, D], kv_caches)."""
        x, kv_caches = _run_layers(self.layers, h, positions, kv_caches, md, embeds)
        return self.norm(x), x, kv_caches

    def greedy(self, out: jax.Array, lm_head=None, *, tied=None, soft_cap=None) -> jax.Array:
        """Its own head over the draft vocabulary -> target token ids i32[T]."""
        best = jnp.argmax(self.draft_head(out).astype(jnp.float32), axis=-1).astype(jnp.int32)
        return best + self.d2t[...][best]

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        """fc, norm, lm_head (here draft_head) and d2t as they are named; the layer's under
        `midlayer.` (its hidden_norm too)."""
        first = str(path[0])
        if first == "fc":
            return HFWeight(("fc.weight",), np.transpose)
        if first == "draft_head":
            return HFWeight(("lm_head.weight",), np.transpose)
        if first == "d2t":
            return HFWeight(("d2t",))
        if first == "norm":
            return HFWeight(("norm.weight",))
        if str(path[2]) == "hidden_norm":
            return HFWeight(("midlayer.hidden_norm.weight",))
        weight = LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        names = tuple(n.replace("model.layers.0.", "midlayer.") for n in weight.names)
        return HFWeight(names, weight.build)
