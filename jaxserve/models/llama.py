"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) in Flax NNX.

One forward call runs a flat batch of tokens from many sequences over a paged KV cache. The
decoder layers' weights are stacked on a leading [L] axis and looped with `lax.scan`, so compile
time does not grow with depth. The KV cache is one pair of arrays [L, num_blocks, block_size,
Hkv, hd]; inside the scan it is viewed as [L * num_blocks, ...] and layer l addresses its blocks
as l * num_blocks + block_id, so the attention op sees an ordinary 4-D paged cache with no
per-layer slice copied out of the carry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import Attention, AttentionMetadata
from jaxserve.layers.mlp import GatedMLP
from jaxserve.layers.norm import RMSNorm

KVCaches = tuple[jax.Array, jax.Array]  # K, V: [L, num_blocks, block_size, Hkv, hd]


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt = config.dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dt, rngs=rngs)

    def __call__(self, x, positions, k_cache, v_cache, md: AttentionMetadata):
        """x: [T, D] -> ([T, D], k_cache, v_cache)."""
        attn_out, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), positions, k_cache, v_cache, md
        )
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = config.dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dt, param_dtype=dt, rngs=rngs
        )

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, rngs=rngs)

        self.layers = make_layers(rngs)  # every parameter has a leading [L] axis
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Einsum(
                "td,dv->tv", (config.hidden_size, config.vocab_size), dtype=dt, param_dtype=dt,
                rngs=rngs,
            )  # fmt: skip

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: KVCaches,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCaches]:
        """input_ids, positions: i32[T] -> (final hidden states [T, D], updated kv_caches)."""
        k_all, v_all = kv_caches
        num_layers, num_blocks, block_size = k_all.shape[:3]
        flat = (num_layers * num_blocks, *k_all.shape[2:])
        h = self.embed_tokens(input_ids)  # [T, D]
        graphdef, layer_state = nnx.split(self.layers)

        def layer_step(carry, xs):
            h, k_cache, v_cache = carry
            state, layer = xs
            offset = layer * num_blocks  # this layer's blocks in the flattened cache
            layer_md = md._replace(
                block_tables=md.block_tables + offset,
                slot_mapping=jnp.where(
                    md.slot_mapping >= 0, md.slot_mapping + offset * block_size, -1
                ),
            )
            h, k_cache, v_cache = nnx.merge(graphdef, state)(
                h, positions, k_cache, v_cache, layer_md
            )
            return (h, k_cache, v_cache), None

        (h, k_flat, v_flat), _ = jax.lax.scan(
            layer_step,
            (h, k_all.reshape(flat), v_all.reshape(flat)),
            (layer_state, jnp.arange(num_layers, dtype=jnp.int32)),
        )
        return self.norm(h), (k_flat.reshape(k_all.shape), v_flat.reshape(v_all.shape))

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, D] (only the rows whose next token is wanted) -> float32 logits [N, V]."""
        if self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple[str, ...]) -> HFWeight:
        """The HF tensor(s) our parameter at `path` comes from (module names mirror HF's).

        ('layers', 'self_attn', 'q_proj', 'kernel') <- model.layers.{i}.self_attn.q_proj.weight
        for every layer i, transposed from HF's [out, in] to our einsum layout [D, Hq, hd].
        """
        d, hq, hkv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        transforms = {
            "q_proj/kernel": lambda w: w.T.reshape(d, hq, hd),
            "k_proj/kernel": lambda w: w.T.reshape(d, hkv, hd),
            "v_proj/kernel": lambda w: w.T.reshape(d, hkv, hd),
            "q_proj/bias": lambda b: b.reshape(hq, hd),
            "k_proj/bias": lambda b: b.reshape(hkv, hd),
            "v_proj/bias": lambda b: b.reshape(hkv, hd),
            "o_proj/kernel": lambda w: w.T.reshape(hq, hd, d),
            "gate_proj/kernel": np.transpose,
            "up_proj/kernel": np.transpose,
            "down_proj/kernel": np.transpose,
            "lm_head/kernel": np.transpose,
        }
        *modules, leaf = path
        transform = transforms.get(f"{modules[-1]}/{leaf}")
        suffix = "bias" if leaf == "bias" else "weight"
        if modules[0] == "lm_head":
            return HFWeight(("lm_head.weight",), transform)
        if modules[0] == "layers":
            inner = ".".join(modules[1:])
            names = tuple(f"model.layers.{i}.{inner}.{suffix}" for i in range(config.num_layers))
            return HFWeight(names, transform, stacked=True)
        return HFWeight((f"model.{'.'.join(modules)}.{suffix}",), transform)


@dataclasses.dataclass(frozen=True)
class HFWeight:
    """HF tensor name(s) for one parameter; `stacked` ones take one tensor per layer."""

    names: tuple[str, ...]
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    stacked: bool = False
