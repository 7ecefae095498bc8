"""DeepSeek Sparse Attention as pure-jnp ops: the lightning indexer's scores over each query's
paged context (`index_logits_reference`), and sparse MLA: each query attends to its own list
of cached tokens, in MLA's absorbed form (`sparse_mla_reference`).

The cache holds one head per token, [latent; rotary key] (576 values for DeepSeek-V3.2: the
kv_lora_rank r = 512 and 64 rotary dims). A query row is [q_latent; q_rope] in the same
layout, so a score is one dot product over the whole head, and the first r columns of the
chosen tokens are the values too (the model applies W_UV after).

`sparse_mla_reference` gathers only the listed tokens ([T, K] of them), so its cost follows
the top-k, not the context: the engine's op on CPU, and the Mosaic GPU kernel's oracle
(`mosaic.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_slots(chosen: jax.Array, block_tables: jax.Array, seq: jax.Array, block_size: int):
    """Context indices -> cache slots: chosen i32[T, K] (index into each query's sequence, -1
    for none), block_tables i32[S, B], seq i32[T] (each query's sequence) -> i32[T, K] slots
    (block id * block_size + offset; -1 where chosen is)."""
    idx = jnp.maximum(chosen, 0)
    blocks = block_tables[seq[:, None], idx // block_size]  # (not a [T, B] copy of the tables)
    return jnp.where(chosen >= 0, blocks * block_size + idx % block_size, -1).astype(jnp.int32)


def sparse_mla_reference(
    q: jax.Array,
    cache: jax.Array,
    slots: jax.Array,
    *,
    sm_scale: float,
    latent_dim: int,
    tile: int = 16,
) -> jax.Array:
    """Attention of each query over its listed tokens.

    Args:
      q: [T, H, D] absorbed queries, D = latent_dim + rotary dims.
      cache: [num_blocks, block_size, R, D] the MLA cache (R copies of the one head: tp's
        replicas; the first is read).
      slots: i32[T, K] each query's tokens as cache slots (block * block_size + offset), -1
        for none; a row without any gives zeros.
      sm_scale: the softmax scale.
      latent_dim: r, the value width (the first r columns of a cached head).
      tile: queries whose gathered tokens ([tile, K, D]) are live at once.

    Returns:
      f32[T, H, latent_dim].
    """
    q, cache, slots = jnp.asarray(q), jnp.asarray(cache), jnp.asarray(slots)
    t, k = slots.shape
    rows = cache.reshape(-1, cache.shape[2], cache.shape[3])[:, 0]  # [N * bs, D]
    pad = -t % tile
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    slots = jnp.pad(slots, ((0, pad), (0, 0)), constant_values=-1)

    def one(i):
        s = jax.lax.dynamic_slice_in_dim(slots, i * tile, tile)  # [Q, K]
        lat = rows[jnp.maximum(s, 0)].astype(jnp.float32)  # [Q, K, D]
        qi = jax.lax.dynamic_slice_in_dim(q, i * tile, tile).astype(jnp.float32)
        score = jnp.einsum("qhd,qkd->qhk", qi, lat) * sm_scale
        score = jnp.where((s >= 0)[:, None], score, -jnp.inf)
        m = jnp.max(score, axis=-1, keepdims=True)
        p = jnp.exp(score - jnp.where(jnp.isfinite(m), m, 0.0))
        l = jnp.sum(p, axis=-1, keepdims=True)
        out = jnp.einsum("qhk,qkd->qhd", p, lat[..., :latent_dim])
        return out / jnp.where(l > 0, l, 1.0)

    out = jax.lax.map(one, jnp.arange((t + pad) // tile))
    return out.reshape(t + pad, q.shape[1], latent_dim)[:t]


def index_logits_reference(iq, iw, cache, tables, positions):
    """iq f32[Q, Hi, Di], iw f32[Q, Hi], cache [N, bs, R, Di], tables i32[Q, B] (each
    query's block table), positions i32[Q] -> f32[Q, B * bs]: the scores of the keys up to
    each query's position, -inf past it."""
    q, b = tables.shape
    bs = cache.shape[1]
    keys = cache[tables, :, 0].reshape(q, b * bs, -1).astype(jnp.float32)
    score = jnp.einsum("qhd,qkd->qhk", iq, keys)
    score = jnp.einsum("qhk,qh->qk", jax.nn.relu(score), iw)
    return jnp.where(jnp.arange(b * bs)[None] <= positions[:, None], score, -jnp.inf)
