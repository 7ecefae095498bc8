"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3's MLA and experts with DeepSeek Sparse
Attention (DSA): a lightning indexer scores every cached token for each query, and the query
attends to its `index_topk` best only.

The indexer (per layer, HF's `self_attn.indexer.*`): queries wq_b(q_resid) [T, Hi, Di] from
the same low-rank query residual as MLA's, one key LayerNorm(wk(x)) [T, Di] per token, the
first qk_rope_head_dim dims of both rotated half-split (MLA's are interleaved; transformers'
reference has no Hadamard transform and no fp8, nor has this); a token s's score for query t
is sum_h relu(q_th . k_s / sqrt(Di)) * w_th, w = weights_proj(x) / sqrt(Hi). Each token's
index key is kept in the layer's V cache, which MLA leaves empty (the K cache holds the latent
and rotary key), so it lives in the same blocks: cache_dims (r + rope, Di). GLM-5's
shared-indexer layers keep none: V holds the full layers' slots only (`v_view`).

The attention: when no sequence of the step has more than index_topk tokens, every token is
selected and it is MLA's (models/deepseek.py, the kernels' path); otherwise each query's top
index_topk context tokens by index score (layers/sparse_mla.py: `index_topk`) and the absorbed
MLA attention over those alone (`sparse_mla_attention`: the jnp reference, or the Mosaic GPU
kernel that reads only their latents).
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import AttentionMetadata, write_kv
from jaxserve.layers.linear import Linear
from jaxserve.layers.rotary import apply_rotary, rope_attention_factor, rope_inv_freq
from jaxserve.layers.sparse_mla import index_topk, sparse_mla_attention
from jaxserve.models.deepseek import DeepseekV3ForCausalLM, MLAAttention, mla_attention
from jaxserve.models.llama import DecoderLayer, HFWeight
from jaxserve.models.weight_maps import GATE_UP_DOWN, compose, routed_experts, shared_experts

INDEX_KEY_NORM_EPS = 1e-6  # HF's indexer k_norm (a LayerNorm with bias)


class Indexer(nnx.Module):
    """wq_b [q_lora, Hi * Di], wk [D, Di], k_norm (weight, bias [Di]), weights_proj [D, Hi]."""

    def __init__(self, config: ModelConfig, *, interleave: bool = False, rngs: nnx.Rngs):
        m, d, dt = config.mla, config.hidden_size, config.dtype
        self.interleave, self.rope_dim = interleave, m.qk_rope_head_dim
        q = config.linear_kwargs()  # fp8 in the published checkpoints, as MLA's; weights_proj not
        self.wq_b = Linear(
            m.q_lora_rank, m.index_n_heads * m.index_head_dim, dtype=dt, rngs=rngs, **q
        )
        self.wk = Linear(d, m.index_head_dim, dtype=dt, rngs=rngs, **q)
        self.k_norm_weight = nnx.Param(jnp.ones(m.index_head_dim, dt))
        self.k_norm_bias = nnx.Param(jnp.zeros(m.index_head_dim, dt))
        self.weights_proj = Linear(d, m.index_n_heads, dtype=dt, rngs=rngs)
        self.heads, self.dim = m.index_n_heads, m.index_head_dim

    def __call__(self, x, q_resid, positions, inv_freq, scale):
        """-> (queries f32[T, Hi, Di], weights f32[T, Hi], keys [T, Di])."""
        t = x.shape[0]
        q = self.wq_b(q_resid).reshape(t, self.heads, self.dim)
        k = self.wk(x).astype(jnp.float32)
        mean = k.mean(-1, keepdims=True)
        var = jnp.square(k - mean).mean(-1, keepdims=True)
        k = (k - mean) * lax.rsqrt(var + INDEX_KEY_NORM_EPS)
        k = (k * self.k_norm_weight[...] + self.k_norm_bias[...]).astype(x.dtype)
        if self.interleave:  # pairs laid out as halves: q . k is the same, rotate-half applies
            q, k = _halves(q, self.rope_dim), _halves(k, self.rope_dim)
        q = apply_rotary(q, positions, inv_freq, scale).astype(jnp.float32)
        k = apply_rotary(k[:, None], positions, inv_freq, scale)[:, 0]
        w = self.weights_proj(x).astype(jnp.float32) * self.heads**-0.5
        return q * self.dim**-0.5, w, k


def _halves(x: jax.Array, rope: int) -> jax.Array:
    """x [..., D]: its first `rope` dims' interleaved pairs as two halves, the rest as is."""
    return jnp.concatenate([x[..., 0:rope:2], x[..., 1:rope:2], x[..., rope:]], axis=-1)


# The top-k the last full indexer layer chose ([T, k] int32, context indices), for the
# "shared" layers after it (GLM-5's), within one forward's trace (models/glm_moe_dsa.py).
SHARED_TOPK: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("topk", default=None)


class DSAAttention(MLAAttention):
    """MLA with the indexer; the V cache [blocks, block_size, R, Di] holds index keys. A
    layer whose `config.mla.index_shared` entry is set has no indexer and attends to the
    tokens the last full layer chose (SHARED_TOPK)."""

    index_interleave = False  # the indexer's rotary pairs interleaved (GLM-5's)

    def __init__(self, config: ModelConfig, *, layer: int = 0, kv_replicas: int = 1, rngs):
        super().__init__(config, layer=layer, kv_replicas=kv_replicas, rngs=rngs)
        flags = config.mla.index_shared  # (an MTP layer, after them all: a full one)
        shared = layer < len(flags) and flags[layer]
        self.indexer = (
            None if shared else Indexer(config, interleave=self.index_interleave, rngs=rngs)
        )
        self.index_topk = config.mla.index_topk
        self.publish = any(flags) and layer < len(flags) and not shared  # for shared ones
        self.v_slots, self.layer = config.v_slots, layer

    def v_view(self, md: AttentionMetadata, k_cache, v_cache) -> AttentionMetadata:
        """This layer's metadata for its V slot (its index keys): its K slot's, or where V
        keeps the full-indexer layers' slots only (GLM-5: KVCacheSpec's v_slots; V then has
        fewer rows than K) its own V slot's blocks."""
        if v_cache.shape[0] == k_cache.shape[0]:
            return md
        n = k_cache.shape[0] // len(self.v_slots)  # blocks of one slot
        shift = (self.v_slots[self.layer] - self.layer) * n
        slots = jnp.where(md.slot_mapping >= 0, md.slot_mapping + shift * k_cache.shape[1], -1)
        table_map = md.table_map and (md.table_map[0], md.table_map[1] + shift)
        return md._replace(
            block_tables=md.block_tables + shift, slot_mapping=slots, table_map=table_map
        )

    def __call__(self, x, positions, k_cache, v_cache, md: AttentionMetadata):
        m = self.mla
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        if self.indexer is None:
            select = SHARED_TOPK.get()
            if select is None:
                raise ValueError("a shared indexer layer needs a full one before it")
        else:
            inv_freq = rope_inv_freq(m.qk_rope_head_dim, self.rope)
            factor = rope_attention_factor(self.rope)
            iq, iw, ik = self.indexer(x, q_resid, positions, inv_freq, factor)
            keys = jnp.broadcast_to(ik[:, None], (x.shape[0], self.num_kv_heads, ik.shape[-1]))
            v_md = self.v_view(md, k_cache, v_cache)
            v_cache = write_kv(v_cache, keys.astype(v_cache.dtype), v_md.slot_mapping)
            select = (iq, iw)
        dense = jnp.max(md.kv_lens) <= self.index_topk
        # [T, k] int32 for the shared layers after this one; only a layer that hands it on
        # keeps it (a prefill's is T x 2048 x 4 bytes)
        k = min(self.index_topk, md.block_tables.shape[1] * k_cache.shape[1])
        all_chosen = jnp.zeros((x.shape[0], k), jnp.int32) if self.publish else None

        def mla(k_cache):
            out, k_cache, _ = super(DSAAttention, self).__call__(x, positions, k_cache, v_cache, md)
            return out, k_cache, all_chosen  # (dense: every token chosen)

        def sparse(k_cache):
            query, q_nope, latent, k_pe = self.project(x, positions, q_resid)
            entry = jnp.concatenate([latent[:, None], k_pe.astype(latent.dtype)], axis=-1)
            entry = jnp.broadcast_to(entry, (x.shape[0], self.num_kv_heads, m.latent_dim))
            k_cache = write_kv(k_cache, entry, md.slot_mapping)
            if isinstance(select, tuple):
                chosen = index_topk(
                    *select,
                    positions,
                    v_cache,
                    v_md,
                    self.index_topk,
                    backend=self.backend,
                    mesh=self.mesh,
                )
            else:
                chosen = select
            out = sparse_mla_attention(
                query,
                chosen,
                k_cache,
                md,
                sm_scale=m.sm_scale,
                latent_dim=m.kv_lora_rank,
                backend=self.backend,
                mesh=self.mesh,
            )
            out = jnp.einsum("thr,hvr->thv", out, self.w_uv[...])
            return (
                self.o_proj(out.reshape(x.shape[0], -1)),
                k_cache,
                chosen if self.publish else None,
            )

        out, k_cache, chosen = lax.cond(dense, mla, sparse, k_cache)
        if self.publish:
            SHARED_TOPK.set(chosen)
        return out, k_cache, v_cache


class DeepseekV32DecoderLayer(DecoderLayer):
    attention_cls = DSAAttention


def indexer_weights(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
    """The indexer's projections and key norm (`self_attn.indexer.*`)."""
    if names[0] != "layers" or names[2:4] != ("self_attn", "indexer"):
        return None
    prefix = f"model.layers.{names[1]}.self_attn.indexer"
    if names[4] in ("k_norm_weight", "k_norm_bias"):
        return HFWeight((f"{prefix}.k_norm.{names[4][7:]}",))
    return HFWeight((f"{prefix}.{names[4]}.weight",), np.transpose)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with DeepSeek Sparse Attention."""

    layer_cls = DeepseekV32DecoderLayer
    hf_weight = compose(
        indexer_weights, mla_attention, shared_experts, routed_experts("mlp", GATE_UP_DOWN)
    )
