"""Ragged paged attention in pure jnp: the reference every kernel must match, and the CPU path.

A batch is a "super-sequence": the query tokens of many sequences laid end to end. Sequence i
owns query rows query_start_loc[i]:query_start_loc[i+1]; they are the last q_len tokens of its
kv_lens[i] cached tokens (their K/V already written to the paged cache), and each attends
causally to every cached token at or before its own position. Prefill chunks (including ones
that start mid-sequence) and single-token decodes mix freely. Rows at or past
query_start_loc[num_seqs] are padding and come back as zeros.

The computation streams over the KV cache a few blocks at a time with an online softmax in
float32, gathering each query row's own blocks, so memory stays O(T x chunk) whatever the
context length; the loop runs only as far as the longest sequence in the batch.
"""

import functools

import jax
import jax.numpy as jnp

_CHUNK_TOKENS = 128  # KV tokens per loop iteration


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
) -> jax.Array:
    """Causal attention of ragged queries over a paged KV cache.

    Args:
      q: [T, Hq, D] queries (rotary already applied).
      k_cache, v_cache: [num_blocks, block_size, Hkv, D]; Hq is a multiple of Hkv (GQA).
      kv_lens: i32[S] cached tokens per sequence, the new ones included.
      block_tables: i32[S, max_blocks] block ids of each sequence, in order.
      query_start_loc: i32[S+1] row offsets of each sequence's queries in q.
      num_seqs: i32[1] number of real sequences; later entries are padding.
      sm_scale: softmax scale, usually head_dim ** -0.5.

    Returns:
      [T, Hq, D] in q's dtype; padding rows are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_seqs, max_blocks = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads

    # Which sequence each query row belongs to, and its position in that sequence.
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    n = num_seqs[0]
    seq_ends = query_start_loc[1:]  # [S]
    real_seq = jnp.arange(max_seqs) < n
    seq = jnp.sum((seq_ends[None, :] <= rows[:, None]) & real_seq[None, :], axis=1)  # [T]
    valid = rows < query_start_loc[n]
    seq = jnp.minimum(seq, max_seqs - 1)
    q_pos = kv_lens[seq] - (seq_ends[seq] - rows)  # [T]
    q_pos = jnp.where(valid, q_pos, -1)  # padding rows see no keys
    row_blocks = block_tables[seq]  # [T, max_blocks]

    blocks_per_chunk = max(1, _CHUNK_TOKENS // block_size)
    chunk_tokens = blocks_per_chunk * block_size
    num_chunks = (jnp.max(q_pos) + chunk_tokens) // chunk_tokens  # chunks covering q_pos + 1 keys

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)

    def body(c, carry):
        m, l, acc = carry  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
        cols = jnp.minimum(c * blocks_per_chunk + jnp.arange(blocks_per_chunk), max_blocks - 1)
        blk = row_blocks[:, cols]  # [T, C]
        k = k_cache[blk].reshape(num_tokens, chunk_tokens, num_kv_heads, head_dim)
        v = v_cache[blk].reshape(num_tokens, chunk_tokens, num_kv_heads, head_dim)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k.astype(jnp.float32)) * sm_scale
        k_pos = c * chunk_tokens + jnp.arange(chunk_tokens)
        mask = (k_pos[None, :] <= q_pos[:, None])[:, None, None, :]  # [T, 1, 1, chunk]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckd->tkgd", p, v.astype(jnp.float32))
        return m_new, l, acc

    shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.full(shape, -1e30, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows with no keys: acc = 0 -> 0
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
