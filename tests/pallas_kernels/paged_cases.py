"""Random ragged paged-attention inputs and a naive per-sequence numpy oracle.

Shared by the reference tests and (later) the Pallas kernel tests.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PagedCase:
    q: np.ndarray  # [T, Hq, D]
    k_cache: np.ndarray  # [num_blocks, block_size, Hkv, D]
    v_cache: np.ndarray
    kv_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, max_blocks]
    query_start_loc: np.ndarray  # [S+1]
    num_seqs: np.ndarray  # [1]

    def args(self):
        return (
            self.q, self.k_cache, self.v_cache, self.kv_lens, self.block_tables,
            self.query_start_loc, self.num_seqs,
        )  # fmt: skip


def make_case(
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=np.float32,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    seed: int = 0,
) -> PagedCase:
    """seqs: (q_len, kv_len) per sequence; blocks are assigned from a shuffled pool."""
    rng = np.random.default_rng(seed)
    blocks_needed = [-(-kv // block_size) for _, kv in seqs]
    max_blocks = max(blocks_needed) + 1
    num_blocks = sum(blocks_needed) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs) + pad_seqs, max_blocks), np.int32)
    used = 0
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = perm[used : used + n]
        used += n
    t = sum(q for q, _ in seqs)
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in seqs]), [t] * pad_seqs]).astype(np.int32)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    return PagedCase(
        q=rand(t + pad_tokens, num_q_heads, head_dim),
        k_cache=rand(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache=rand(num_blocks, block_size, num_kv_heads, head_dim),
        kv_lens=np.array([kv for _, kv in seqs] + [0] * pad_seqs, np.int32),
        block_tables=tables,
        query_start_loc=qsl,
        num_seqs=np.array([len(seqs)], np.int32),
    )


def naive_attention(
    case: PagedCase,
    sm_scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: np.ndarray | None = None,
    chunk: int | None = None,
    causal_ext: np.ndarray | None = None,
) -> np.ndarray:
    """Dense causal attention per sequence in float64 (each query sees the `window` latest
    keys up to its own when a window is given; scores soft-capped when asked; sinks [Hq]: a
    logit per head in the softmax whose value is zero, as HF's gpt-oss appends it; chunk: keys
    of the query's own chunk of positions only, Llama 4's; causal_ext [T]: each query also
    sees that many keys after its own, Gemma 3's bidirectional images); padding rows
    zero."""
    q = case.q.astype(np.float64)
    k_all, v_all = case.k_cache.astype(np.float64), case.v_cache.astype(np.float64)
    _, block_size, hkv, d = k_all.shape
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for i in range(int(case.num_seqs[0])):
        start, end = case.query_start_loc[i], case.query_start_loc[i + 1]
        kv_len = case.kv_lens[i]
        n_blocks = -(-kv_len // block_size)
        k = k_all[case.block_tables[i, :n_blocks]].reshape(-1, hkv, d)[:kv_len]
        v = v_all[case.block_tables[i, :n_blocks]].reshape(-1, hkv, d)[:kv_len]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [kv_len, Hq, D]
        q_pos = kv_len - (end - np.arange(start, end))  # [q_len]
        s = np.einsum("qhd,khd->hqk", q[start:end], k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        k_pos = np.arange(kv_len)[None, None, :]
        q_lim = q_pos if causal_ext is None else q_pos + causal_ext[start:end]
        seen = k_pos <= q_lim[None, :, None]
        if window is not None:
            seen &= k_pos > q_pos[None, :, None] - window
        if chunk is not None:
            seen &= k_pos // chunk == q_pos[None, :, None] // chunk
        s = np.where(seen, s, -np.inf)
        if sinks is not None:  # one more column, dropped after the softmax
            column = np.broadcast_to(sinks.astype(np.float64)[:, None, None], (*s.shape[:2], 1))
            s = np.concatenate([s, column], axis=-1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[start:end] = np.einsum("hqk,khd->qhd", p[..., :kv_len], v)
    return out
