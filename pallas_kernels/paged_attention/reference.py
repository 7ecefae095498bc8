"""Ragged paged attention in pure jnp: the reference every kernel must match, and the CPU path.

A batch is a "super-sequence": the query tokens of many sequences laid end to end. Sequence i
owns query rows query_start_loc[i]:query_start_loc[i+1]; they are the last q_len tokens of its
kv_lens[i] cached tokens (their K/V already written to the paged cache), and each attends
causally to every cached token at or before its own position. Prefill chunks (including ones
that start mid-sequence) and single-token decodes mix freely. Rows at or past
query_start_loc[num_seqs] are padding and come back as zeros.

The computation streams over the KV cache a chunk of blocks at a time with an online softmax in
float32, so memory stays bounded whatever the context length; the loop runs only as far as the
longest sequence in the batch. Which rows share a chunk's gather depends on the sequence:
  decode   a sequence with one query token: its row gathers the sequence's blocks;
  tiled    a sequence with several (a prefill chunk): its rows are cut into tiles of _Q_TILE
           consecutive tokens and each tile gathers the sequence's blocks once for all its
           rows (per-row gathers made a prefill step's attention 3-5x slower on CPU); tiles
           run _TILE_GROUP at a time, each group only as far as its own rows need.
Both run in every call (a batch without one kind skips its loop: zero iterations), unless the
caller says the batch is decode-only (`decode_only`), when only the first is traced.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

# KV tokens per loop iteration. Smaller chunks waste less past each row's context but cost
# more iterations: these were the fastest on a 2-core CPU (SmolLM2 shapes, contexts 96-600).
_DECODE_CHUNK_TOKENS = 32
_TILED_CHUNK_TOKENS = 64
_Q_TILE = 16  # query rows per tile (the tiled path)
_TILE_GROUP = 4  # tiles attended together (the tiled path)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "decode_only", "attention_chunk"),
)
def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    sinks: jax.Array | None = None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    decode_only: bool = False,
    attention_chunk: int | None = None,
    causal_ext: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ragged queries over a paged KV cache.

    Args:
      q: [T, Hq, D] queries (rotary already applied).
      k_cache, v_cache: [num_blocks, block_size, Hkv, D]; Hq is a multiple of Hkv (GQA).
      kv_lens: i32[S] cached tokens per sequence, the new ones included.
      block_tables: i32[S, max_blocks] block ids of each sequence, in order.
      query_start_loc: i32[S+1] row offsets of each sequence's queries in q.
      num_seqs: i32[1] number of real sequences; later entries are padding.
      sinks: [Hq] or None: attention sinks (gpt-oss), a logit per query head that each
        row's softmax denominator also sums (a key with no value): the weights of the real
        keys sum to less than 1.
      sm_scale: softmax scale, usually head_dim ** -0.5.
      sliding_window: each query sees only the latest this many keys (its own included), as
        HF's sliding-window mask; the keys before every row's window are not read.
      soft_cap: scores become soft_cap * tanh(score / soft_cap) (Gemma 2).
      attention_chunk: each query sees only the keys of its own chunk (positions
        c * attention_chunk .. its own, Llama 4's chunked attention); earlier keys are not read.
      decode_only: the caller promises every real sequence has one query token: the path of
        prefill chunks is left out (a sequence with more would get zeros).
      causal_ext: i32[T] or None: each query also sees the keys up to this many positions
        after its own (Gemma 3's bidirectional attention among one image's tokens, all in the
        same prefill chunk); the sliding window still counts back from its own position.

    Returns:
      [T, Hq, D] in q's dtype; padding rows are zero.
    """
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    scores = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        attention_chunk=attention_chunk,
    )
    single = _q_lens(q, k_cache, block_tables, query_start_loc, num_seqs) == 1
    out = _decode(*args[:6], _Scores(**scores), single, sinks)
    if decode_only or q.shape[0] == 1:
        return out
    return multi_token_rows(*args, out, sinks, **scores, causal_ext=causal_ext)


def multi_token_rows(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    out: jax.Array,
    sinks: jax.Array | None = None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    attention_chunk: int | None = None,
    causal_ext: jax.Array | None = None,
) -> jax.Array:
    """The reference's rows of sequences with several query tokens (prefill chunks), written
    into out [T, Hq, D] (which holds the decode rows, from a kernel); arguments as
    `ragged_paged_attention_reference`'s. For a kernel that does decodes alone."""
    q_lens = _q_lens(q, k_cache, block_tables, query_start_loc, num_seqs)
    scores = _Scores(sm_scale, sliding_window, soft_cap, attention_chunk)
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, scores)
    return _tiled(*args, jnp.where(q_lens == 1, 0, q_lens), out, sinks, causal_ext)


def _q_lens(q, k_cache, block_tables, query_start_loc, num_seqs):
    """Query tokens per sequence, i32[S] (0 for padding sequences)."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    real = jnp.arange(block_tables.shape[0]) < num_seqs[0]
    return jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)


class _Scores(NamedTuple):
    """How scores are formed (static): scale, sliding window, soft cap, attention chunk."""

    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    attention_chunk: int | None = None


def _decode(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, scores, single, sinks):
    """The sequences with one query token (single: bool[S]), one row each. -> [T, Hq, D], the
    other rows zero."""
    num_tokens = q.shape[0]
    row = jnp.where(single, query_start_loc[:-1], num_tokens)  # [S]; T: dropped
    q_pos = jnp.where(single, kv_lens - 1, -1)[:, None]  # [S, 1]: others see no keys
    q_rows = q[jnp.minimum(row, num_tokens - 1), None]  # [S, 1, Hq, D]
    res = _attend(
        q_rows, q_pos, block_tables, k_cache, v_cache, scores, _DECODE_CHUNK_TOKENS, sinks
    )
    return jnp.zeros_like(q).at[row].set(res[:, 0], mode="drop")


def _tiled(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    scores,
    q_lens,
    out,
    sinks,
    causal_ext=None,
):
    """The sequences with q_lens [S] > 0 (several query tokens): sequence s gets
    ceil(q_len / _Q_TILE) tiles of its consecutive rows, in order; a tile attends with its
    sequence's blocks, gathered once per chunk for all its rows. Writes their rows of out."""
    num_tokens, num_q_heads, head_dim = q.shape
    max_seqs = block_tables.shape[0]
    tiles = (q_lens + _Q_TILE - 1) // _Q_TILE  # [S]
    ends = jnp.cumsum(tiles)
    max_tiles = -(-num_tokens // _Q_TILE) + min(max_seqs, num_tokens // 2)  # static bound
    tile_ids = jnp.arange(max_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, tile_ids, side="right"), max_seqs - 1)
    first = (tile_ids - (ends[seq] - tiles[seq])) * _Q_TILE  # first row within its sequence
    r = first[:, None] + jnp.arange(_Q_TILE)  # [NT, Q]: row within the sequence
    valid = (tile_ids < ends[-1])[:, None] & (r < q_lens[seq][:, None])
    token = jnp.where(valid, query_start_loc[seq][:, None] + r, num_tokens)  # T: dropped
    q_pos = jnp.where(valid, kv_lens[seq][:, None] - q_lens[seq][:, None] + r, -1)  # [NT, Q]
    q_lim = q_pos  # the last key position each row sees
    if causal_ext is not None:
        q_lim = jnp.where(valid, q_pos + causal_ext[jnp.minimum(token, num_tokens - 1)], -1)
    # Only the first ends[-1] tiles hold rows: run them _TILE_GROUP at a time, each group
    # streaming only as many chunks as its own rows need.
    num_groups = -(-max_tiles // _TILE_GROUP)
    pad = num_groups * _TILE_GROUP - max_tiles
    token = jnp.pad(token, ((0, pad), (0, 0)), constant_values=num_tokens)
    q_pos = jnp.pad(q_pos, ((0, pad), (0, 0)), constant_values=-1)
    q_lim = jnp.pad(q_lim, ((0, pad), (0, 0)), constant_values=-1)
    blocks = jnp.pad(block_tables[seq], ((0, pad), (0, 0)))

    def group(i, out):
        at = i * _TILE_GROUP
        tok = jax.lax.dynamic_slice_in_dim(token, at, _TILE_GROUP)  # [TG, Q]
        pos = jax.lax.dynamic_slice_in_dim(q_pos, at, _TILE_GROUP)
        lim = jax.lax.dynamic_slice_in_dim(q_lim, at, _TILE_GROUP)
        blk = jax.lax.dynamic_slice_in_dim(blocks, at, _TILE_GROUP)
        q_rows = q[jnp.minimum(tok, num_tokens - 1)]
        res = _attend(
            q_rows,
            pos,
            blk,
            k_cache,
            v_cache,
            scores,
            _TILED_CHUNK_TOKENS,
            sinks,
            lim if causal_ext is not None else None,
        )
        return out.at[tok.reshape(-1)].set(res.reshape(-1, num_q_heads, head_dim), mode="drop")

    used_groups = (ends[-1] + _TILE_GROUP - 1) // _TILE_GROUP
    return jax.lax.fori_loop(0, used_groups, group, out)


def _attend(q, q_pos, blocks, k_cache, v_cache, scores, chunk_tokens, sinks=None, q_lim=None):
    """Online-softmax attention of R groups of rows, each group over one sequence's blocks.

    q: [R, Q, Hq, D]; q_pos: i32[R, Q] each row's position (-1: padding, sees no keys);
    q_lim: i32[R, Q] the last key position each row sees (None: q_pos, causal);
    blocks: i32[R, max_blocks] the group's block table; keys are streamed chunk_tokens (rounded
    to whole blocks) at a time, from the first chunk any row's window reaches; sinks [Hq] (or
    None) join each row's softmax as keys without values. Returns [R, Q, Hq, D] in q's dtype.
    """
    num_groups, group_rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = blocks.shape[1]
    g = num_q_heads // num_kv_heads
    blocks_per_chunk = max(1, chunk_tokens // block_size)
    chunk = blocks_per_chunk * block_size
    sm_scale, window, soft_cap, attention_chunk = scores
    q_lim = q_pos if q_lim is None else q_lim
    num_chunks = (jnp.max(q_lim) + chunk) // chunk  # chunks covering q_lim + 1 keys
    first_chunk = 0
    if window is not None or attention_chunk is not None:  # the earliest key any row sees
        lowest = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max))
        first_key = jnp.maximum(lowest - window + 1, 0) if window is not None else 0
        if attention_chunk is not None:
            first_key = jnp.maximum(first_key, lowest - lowest % attention_chunk)
        first_chunk = jnp.minimum(first_key // chunk, num_chunks)
    # [R, Hkv, Q, G, D]: each (group, KV head) is one [Q*G, D] x [D, chunk] product
    qg = q.reshape(num_groups, group_rows, num_kv_heads, g, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.astype(jnp.float32) * sm_scale

    def body(c, carry):
        m, l, acc = carry  # [R, Hkv, Q, G], [R, Hkv, Q, G], [R, Hkv, Q, G, D]
        cols = jnp.minimum(c * blocks_per_chunk + jnp.arange(blocks_per_chunk), max_blocks - 1)
        blk = blocks[:, cols]  # [R, C blocks]
        k = k_cache[blk].reshape(num_groups, chunk, num_kv_heads, head_dim)
        v = v_cache[blk].reshape(num_groups, chunk, num_kv_heads, head_dim)
        s = jnp.einsum("rkqgd,rckd->rkqgc", qg, k.astype(jnp.float32))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = c * chunk + jnp.arange(chunk)
        seen = k_pos[None, None, :] <= q_lim[:, :, None]  # [R, Q, C]
        if window is not None:
            seen &= k_pos[None, None, :] > q_pos[:, :, None] - window
        if attention_chunk is not None:
            seen &= k_pos[None, None, :] >= (q_pos - q_pos % attention_chunk)[:, :, None]
        mask = seen[:, None, :, None, :]  # [R, 1, Q, 1, C]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("rkqgc,rckd->rkqgd", p, v.astype(jnp.float32))
        return m_new, l, acc

    shape = (num_groups, num_kv_heads, group_rows, g)
    init = (
        jnp.full(shape, -1e30, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(first_chunk, num_chunks, body, init)
    if sinks is not None:  # one more logit per head in the denominator
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, 1, g)
        m_all = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_all)
        l, acc = alpha * l + jnp.exp(sink - m_all), alpha[..., None] * acc
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows with no keys: acc = 0 -> 0
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_groups, group_rows, num_q_heads, head_dim)
    return out.astype(q.dtype)
