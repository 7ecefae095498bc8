"""Ragged paged attention as a Pallas GPU kernel (Triton backend): decodes and prefill chunks
in one batch, over the paged KV cache the engine writes.

Same signature and semantics as `reference.ragged_paged_attention_reference` (read its
docstring for the batch layout), plus keyword-only tuning arguments and `interpret`.

Two kernels. A decode-only step (static `decode_only`: the model runner knows from the
scheduler's output whether every sequence of a step has one new token, and compiles a forward
per layout) runs the decode kernel alone; any other step runs the decode kernel over its
single-token sequences and the mixed kernel over the others. No `lax.cond` chooses between
them at run time (that compiled both into every step).

- **decode** (one query token per sequence): one program per (sequence, KV head, KV split).
  The GQA group's query heads (padded to 16 rows, the smallest `tl.dot`) share each K/V page
  load, so a page is read once per KV head. A small batch cuts each context into
  `num_kv_splits` page ranges run by separate programs, whose partial (max, sum, output) are
  merged afterwards in XLA (split-K / flash-decoding); a batch that fills the SMs alone is
  not split, and the kernel writes the output itself.
- **mixed** (the multi-token sequences: prompts, prefill chunks): queries are tiled too. For
  each KV head the rows (token, head-in-group) of a sequence are laid out contiguously, so a
  tile of `q_block` rows is one slice; one program per (tile, KV head) streams the keys the
  tile can see (causal, up to its last row's position) with an online softmax. Tiles are
  assigned to sequences by a small XLA prologue over `query_start_loc`, so tile counts follow
  the batch without changing the grid. Few tiles over long contexts (a speculative
  verification, a short prompt after a cached prefix) have each tile's keys split across
  `mixed_kv_splits` programs too, merged as the decode kernel's are.

Softmax statistics and accumulators are float32 whatever the input dtype; scores use exp2
with log2(e) folded into the scale. K/V pages are gathered through the block table inside
the kernel (no copy of the cache); the cache layout is the engine's own
`[num_blocks, block_size, Hkv, D]`, read for one KV head through a strided block spec.

This module holds the kernels and their `pallas_call`s. How a call is tiled (KV tokens per
step and stages within shared memory, KV splits, query tiles) is `tiling.py`'s arithmetic.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.tiling import (
    HOPPER_SMEM_BYTES,
    assign_tiles,
    decode_rows,
    decode_seqs,
    merge_splits,
    plan_attention,
)

_LOG2E = math.log2(math.e)
MLA_HEADS = 16  # query heads per MLA program: its f32 [16, latent] accumulator in registers
_M_INIT = -1e30  # finite "minus infinity": empty rows merge to 0 without NaN


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    """A block spec giving every program the whole array (indexed by hand in the kernel)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _kv_head_spec(
    cache_shape: tuple[int, ...],
    head_axis: int,
    *,
    blocks: int = 1,
    columns: tuple[int, int] | None = None,
) -> pl.BlockSpec:
    """[num_blocks, block_size, Hkv, D] -> one KV head's [num_blocks, block_size, D] view:
    the head of program axis `head_axis`'s index // blocks (`blocks` programs share a head:
    its query heads split in blocks). columns (width, block): only those `width` columns,
    from `block` * width on (MLA's latent or rotary part of its one head)."""
    num_blocks, block_size, _, head_dim = cache_shape
    width, column = (head_dim, 0) if columns is None else columns
    return pl.BlockSpec(
        (num_blocks, block_size, None, width),
        lambda *idx: (0, 0, idx[head_axis] // blocks, column),
    )


def _attend(
    q,
    k_ref,
    v_ref,
    block_tables_ref,
    seq,
    first_page,
    num_steps,
    visible,
    *,
    max_blocks,
    pages_per_step,
    scale,
    exact,
    soft_cap=None,
    q_rope=None,
    kr_ref=None,
):
    """Online softmax of q [R, D] over `num_steps` steps of `pages_per_step` pages of sequence
    `seq`, from its page `first_page` on. visible(key_pos i32[K]) -> bool[R, K] says which keys
    each row may see. Returns m, l: f32[R] (log2 units) and the unnormalised acc: f32[R, D].
    MLA: v_ref None (the values are the keys k_ref holds: the latent), and q_rope [R, rope]
    with kr_ref (the rotary keys) add their scores to q's."""
    rows, head_dim = q.shape
    block_size = k_ref.shape[1]
    step_tokens = pages_per_step * block_size

    def body(j, carry):
        m, l, acc = carry
        page0 = first_page + j * pages_per_step
        idx = jnp.minimum(page0 + jnp.arange(pages_per_step), max_blocks - 1)
        pages = block_tables_ref[seq * max_blocks + idx]  # [P] block ids
        k = k_ref[pages].reshape(step_tokens, head_dim)  # [P, bs, D] gathered -> [K, D]
        v = k if v_ref is None else v_ref[pages].reshape(step_tokens, head_dim)
        if k.dtype != q.dtype:  # an fp8 cache, widened once loaded (its scales apply outside)
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=not exact)  # [R, K] f32
        if q_rope is not None:
            k_pe = kr_ref[pages].reshape(step_tokens, q_rope.shape[1]).astype(q.dtype)
            s += plgpu.dot(q_rope, k_pe, trans_b=True, allow_tf32=not exact)
        s = s * scale
        if soft_cap is not None:  # cap the natural-log scores: scale holds log2(e)
            cap = soft_cap * _LOG2E
            s = cap * jnp.tanh(s / cap)
        s = jnp.where(visible(page0 * block_size + jnp.arange(step_tokens)), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact)
        return m_new, l, acc

    init = (
        jnp.full((rows,), _M_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    return jax.lax.fori_loop(0, num_steps, body, init)


def _with_sink(m, l, acc, sink):
    """A softmax's (m, l, acc) (log2 units) with one more logit, sink f32[R] (log2 units),
    in its denominator: an attention sink, a key without a value."""
    m_all = jnp.maximum(m, sink)
    alpha = jnp.exp2(m - m_all)
    return m_all, alpha * l + jnp.exp2(sink - m_all), alpha[:, None] * acc


def _decode_kernel(
    kv_lens_ref,
    block_tables_ref,
    q_ref,
    k_ref,
    v_ref,
    sinks_ref,
    qr_ref,
    kr_ref,
    o_ref,
    m_ref=None,
    l_ref=None,
    *,
    max_blocks: int,
    pages_per_step: int,
    num_splits: int,
    scale: float,
    exact: bool,
    window: int | None,
    soft_cap: float | None,
    sinks: bool,
    chunk: int | None,
):
    """Program (seq, kv_head, split): q_ref [BH, D] -> o_ref [BH, D] and m_ref/l_ref [BH]
    (this split's partial softmax); with one split, o_ref [BH, D] is the output and m_ref /
    l_ref are absent. sinks_ref [BH]: the rows' sink logits (log2 units), read when `sinks`
    (with several splits the merge adds them). MLA: v_ref None, qr_ref [BH, rope] and kr_ref
    the rotary parts (`_attend`); otherwise those two are None."""
    seq, split = pl.program_id(0), pl.program_id(2)
    block_size = k_ref.shape[1]
    kv_len = kv_lens_ref[seq]
    num_pages = pl.cdiv(kv_len, block_size)
    lowest_key = 0 if window is None else jnp.maximum(kv_len - window, 0)
    if chunk is not None:  # the row (position kv_len - 1) sees only its own chunk
        lowest_key = jnp.maximum(lowest_key, (kv_len - 1) - (kv_len - 1) % chunk)
    start_page = lowest_key // block_size  # pages before the window are not read
    per_split = pl.cdiv(pl.cdiv(num_pages - start_page, num_splits), pages_per_step)
    per_split *= pages_per_step
    first = start_page + split * per_split
    last = jnp.minimum(first + per_split, num_pages)
    num_steps = pl.cdiv(jnp.maximum(last - first, 0), pages_per_step)

    rows = q_ref.shape[0]

    def visible(key_pos):
        seen = (key_pos < kv_len) & (key_pos >= lowest_key)
        return jnp.broadcast_to(seen[None, :], (rows, key_pos.shape[0]))

    m, l, acc = _attend(
        q_ref[...],
        k_ref,
        v_ref,
        block_tables_ref,
        seq,
        first,
        num_steps,
        visible,
        max_blocks=max_blocks,
        pages_per_step=pages_per_step,
        scale=scale,
        exact=exact,
        soft_cap=soft_cap,
        q_rope=None if qr_ref is None else qr_ref[...],
        kr_ref=kr_ref,
    )
    if num_splits == 1:  # the whole context was this program's: the output itself
        if sinks:
            m, l, acc = _with_sink(m, l, acc, sinks_ref[...])
        o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
        return
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _mixed_kernel(
    tile_seq_ref,
    tile_row_ref,
    kv_lens_ref,
    query_start_loc_ref,
    block_tables_ref,
    q_ref,
    k_ref,
    v_ref,
    sinks_ref,
    qr_ref,
    kr_ref,
    o_ref,
    m_ref=None,
    l_ref=None,
    *,
    group: int,
    q_block: int,
    max_blocks: int,
    pages_per_step: int,
    num_splits: int,
    scale: float,
    exact: bool,
    window: int | None,
    soft_cap: float | None,
    sinks: bool,
    chunk: int | None,
):
    """Program (tile, kv_head, split): q_ref/o_ref [T*G + q_block, D] rows of this KV head;
    with several splits, o_ref holds this split's unnormalised float32 output and m_ref /
    l_ref [T*G + q_block] its softmax statistics, for the rows of the tile's keys this split
    covers. sinks_ref [BH]: the sink logit (log2 units) of head-in-group g at g, read when
    `sinks` (with several splits the merge adds them). MLA: as the decode kernel's."""
    tile, split = pl.program_id(0), pl.program_id(2)
    seq = tile_seq_ref[tile]

    @pl.when(seq >= 0)
    def _():
        block_size = k_ref.shape[1]
        head_dim = q_ref.shape[1]
        row0 = tile_row_ref[tile]  # first row of the tile within its sequence
        q_start = query_start_loc_ref[seq]
        q_len = query_start_loc_ref[seq + 1] - q_start
        kv_len = kv_lens_ref[seq]
        rows = row0 + jnp.arange(q_block)
        tok = rows // group
        row_ok = tok < q_len
        q_pos = kv_len - q_len + tok  # [R] position of each row's token
        base = q_start * group + row0
        mask = jnp.broadcast_to(row_ok[:, None], (q_block, head_dim))
        q = plgpu.load(q_ref.at[pl.ds(base, q_block), :], mask=mask, other=0.0)
        q_rope = None
        if qr_ref is not None:
            rope_mask = jnp.broadcast_to(row_ok[:, None], (q_block, qr_ref.shape[1]))
            q_rope = plgpu.load(qr_ref.at[pl.ds(base, q_block), :], mask=rope_mask, other=0.0)

        last_tok = jnp.minimum((row0 + q_block - 1) // group, q_len - 1)
        num_keys = kv_len - q_len + last_tok + 1  # keys visible to the tile's last row
        first_page = 0
        first_pos = kv_len - q_len + row0 // group  # the tile's first row's position
        if window is not None or chunk is not None:  # nothing before the first row's
            first_key = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)
            if chunk is not None:  # window, nor before its chunk
                first_key = jnp.maximum(first_key, first_pos - first_pos % chunk)
            first_page = first_key // block_size
        step_tokens = pages_per_step * block_size
        num_steps = pl.cdiv(jnp.maximum(num_keys - first_page * block_size, 0), step_tokens)
        if num_splits > 1:  # this split's share of the tile's steps
            per_split = pl.cdiv(num_steps, num_splits)
            first_page += split * per_split * pages_per_step
            num_steps = jnp.clip(num_steps - split * per_split, 0, per_split)

        def visible(key_pos):
            seen = key_pos[None, :] <= q_pos[:, None]
            if window is not None:
                seen &= key_pos[None, :] > q_pos[:, None] - window
            if chunk is not None:
                seen &= key_pos[None, :] >= (q_pos - q_pos % chunk)[:, None]
            return seen

        m, l, acc = _attend(
            q,
            k_ref,
            v_ref,
            block_tables_ref,
            seq,
            first_page,
            num_steps,
            visible,
            max_blocks=max_blocks,
            pages_per_step=pages_per_step,
            scale=scale,
            exact=exact,
            soft_cap=soft_cap,
            q_rope=q_rope,
            kr_ref=kr_ref,
        )
        rows_here = pl.ds(base, q_block)
        if num_splits == 1:
            if sinks:
                m, l, acc = _with_sink(m, l, acc, sinks_ref[rows % group])
            out = acc / jnp.maximum(l, 1e-30)[:, None]
            plgpu.store(o_ref.at[rows_here, :], out.astype(o_ref.dtype), mask=mask)
        else:
            plgpu.store(o_ref.at[rows_here, :], acc, mask=mask)
            plgpu.store(m_ref.at[rows_here], m, mask=row_ok)
            plgpu.store(l_ref.at[rows_here], l, mask=row_ok)


def _partial_outputs(part: tuple[int, ...], index, head_dim: int):
    """out_specs and out_shape of a split kernel's float32 partials: the unnormalised output
    part + [D] and its softmax max and sum, part; index(*program_ids) gives each program's
    block of part (one element along every axis but the last, which it holds whole)."""
    block = (*(None,) * (len(part) - 1), part[-1])
    specs = [
        pl.BlockSpec((*block, head_dim), lambda *ids: (*index(*ids), 0)),
        pl.BlockSpec(block, index),
        pl.BlockSpec(block, index),
    ]
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    return specs, [f32((*part, head_dim)), f32(part), f32(part)]


def _sink_rows(sinks: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """Sinks [Hq] -> f32[Hkv, rows] in log2 units, each KV head's group of query heads
    padded to `rows`."""
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, -1) * _LOG2E
    return jnp.pad(per_head, ((0, 0), (0, rows - per_head.shape[1])))


def _with_inputs(kernel, required, optional):
    """A pallas_call's kernel, in_specs and operands: `required` (spec, operand) pairs, then
    the `optional` ones, each a pair or None. An absent one has neither spec nor operand (no
    per-program read); the kernel gets None for its ref."""
    present = [pair for pair in optional if pair is not None]
    inputs = [*required, *present]
    slots = [pair is not None for pair in optional]
    fixed, given = len(required), len(inputs)

    def call(*refs):
        extra = iter(refs[fixed:given])
        chosen = [next(extra) if slot else None for slot in slots]
        return kernel(*refs[:fixed], *chosen, *refs[given:])

    return call, [spec for spec, _ in inputs], [arg for _, arg in inputs]


def _latent_views(spec_fn, width: int, latent: int | None):
    """MLA: an operand's two column views, the latent's [.., latent] and the rotary part's
    [.., width - latent] (from column `latent`, a whole number of rotary widths); without
    MLA, the whole width and no second view. spec_fn(width, column_block) -> BlockSpec."""
    if latent is None:
        return spec_fn(width, 0), None
    rope = width - latent
    return spec_fn(latent, 0), spec_fn(rope, latent // rope)


def _cache_inputs(k_cache, v_cache, *, blocks, latent, sink, q_rope):
    """Both kernels' cache operands: the required K (MLA: its latent columns) and the
    optional [V (none for MLA), sink, q_rope (MLA's rotary query), K's rotary columns (MLA)]
    for `_with_inputs`; sink and q_rope are (spec, operand) pairs or None."""
    k_spec, kr_spec = _latent_views(
        lambda w, c: _kv_head_spec(k_cache.shape, 1, blocks=blocks, columns=(w, c)),
        k_cache.shape[-1],
        latent,
    )
    v = None if latent is not None else (_kv_head_spec(v_cache.shape, 1), v_cache)
    k_rope = None if latent is None else (kr_spec, k_cache)
    return (k_spec, k_cache), [v, sink, q_rope, k_rope]


def split_heads(q: jax.Array, num_kv_heads: int, max_group: int | None) -> tuple[jax.Array, int]:
    """q [T, Hq, D] -> ([T, Hkv * blocks, g, D], blocks): each KV head's group of query heads
    in `blocks` blocks of g <= max_group heads (None: one block), the group padded with zero
    heads to blocks * g. The kernels then treat each block as a KV head of its own, reading
    the cache head block // blocks."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    blocks = 1 if max_group is None else -(-group // max_group)
    g = -(-group // blocks)
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, blocks * g - group), (0, 0)))
    return q.reshape(num_tokens, num_kv_heads * blocks, g, head_dim), blocks


def _decode(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    sinks,
    *,
    scale,
    exact,
    pages_per_step,
    num_splits,
    num_warps,
    num_stages,
    interpret,
    window,
    soft_cap,
    chunk,
    blocks,
    latent,
):
    """The decode kernel over each sequence's first query row of q [T, Hv, g, D] (query head
    blocks: `split_heads`) -> (rows [S, Hv, g, Dv] in q's dtype, dest i32[S]: the token each
    row belongs to, T for sequences with kv_lens 0). Dv: D, or MLA's `latent`."""
    num_tokens, num_heads, group, head_dim = q.shape
    max_seqs, max_blocks = block_tables.shape
    rows = decode_rows(group)
    out_dim = head_dim if latent is None else latent

    # Each sequence's single query row, its heads padded to a dot-sized row block.
    q_rows = q[jnp.minimum(query_start_loc[:max_seqs], num_tokens - 1)]
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

    kernel = functools.partial(
        _decode_kernel,
        max_blocks=max_blocks,
        pages_per_step=pages_per_step,
        num_splits=num_splits,
        scale=scale,
        exact=exact,
        window=window,
        soft_cap=soft_cap,
        sinks=sinks is not None,
        chunk=chunk,
    )
    sink_rows = None if sinks is None else _sink_rows(sinks, num_heads, rows)
    q_spec, qr_spec = _latent_views(
        lambda w, c: pl.BlockSpec((None, None, rows, w), lambda s, h, k: (s, h, 0, c)),
        head_dim,
        latent,
    )
    k_input, optional = _cache_inputs(
        k_cache,
        v_cache,
        blocks=blocks,
        latent=latent,
        sink=None
        if sinks is None
        else (pl.BlockSpec((None, rows), lambda s, h, k: (h, 0)), sink_rows),
        q_rope=None if latent is None else (qr_spec, q_rows),
    )
    kernel, in_specs, args = _with_inputs(
        kernel,
        [
            (_whole((max_seqs,)), kv_lens),
            (_whole((max_seqs * max_blocks,)), block_tables.reshape(-1)),
            (q_spec, q_rows),
            k_input,
        ],
        optional,
    )
    if num_splits == 1:  # the kernel writes the output rows in q's dtype: nothing to merge
        out_specs = pl.BlockSpec((None, None, rows, out_dim), lambda s, h, k: (s, h, 0, 0))
        out_shape = jax.ShapeDtypeStruct((max_seqs, num_heads, rows, out_dim), q.dtype)
    else:  # per split: the unnormalised output and its softmax statistics
        out_specs, out_shape = _partial_outputs(
            (num_splits, max_seqs, num_heads, rows), lambda s, h, k: (k, s, h, 0), out_dim
        )
    result = pl.pallas_call(
        kernel,
        grid=(max_seqs, num_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_decode",
    )(*args)

    out = result if num_splits == 1 else merge_splits(*result, sink_rows)  # [S, Hv, rows, Dv]
    out = out[:, :, :group].astype(q.dtype)
    # Each sequence's row goes back to its token; sequences that read nothing go nowhere.
    return out, jnp.where(kv_lens > 0, query_start_loc[:max_seqs], num_tokens)


def _mixed(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    sinks,
    *,
    scale,
    exact,
    q_block,
    pages_per_step,
    num_splits,
    num_warps,
    num_stages,
    interpret,
    window,
    soft_cap,
    chunk,
    blocks,
    latent,
):
    """The mixed kernel over q [T, Hv, g, D] (query head blocks: `split_heads`) -> [T, Hv, g,
    Dv] in q's dtype, the multi-token sequences' rows (the others hold garbage)."""
    num_tokens, num_heads, group, head_dim = q.shape
    max_seqs, max_blocks = block_tables.shape
    num_rows = num_tokens * group
    out_dim = head_dim if latent is None else latent

    # Each multi-token sequence's query tiles (single-token ones have none): tile -> sequence
    # (-1 past the last) and its first row in the sequence.
    tile_seq, tile_row = assign_tiles(
        query_start_loc, num_seqs, num_tokens=num_tokens, group=group, q_block=q_block
    )
    max_tiles = tile_seq.shape[0]

    # Per head block, the rows (token, head-in-block) laid out contiguously, padded by one
    # tile so a tile's slice never runs past the end.
    q_rows = q.transpose(1, 0, 2, 3).reshape(num_heads, num_rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, q_block), (0, 0)))
    padded = num_rows + q_block

    def rows_spec(width, column):
        return pl.BlockSpec((None, padded, width), lambda t, h, k: (h, 0, column))

    kernel = functools.partial(
        _mixed_kernel,
        group=group,
        q_block=q_block,
        max_blocks=max_blocks,
        pages_per_step=pages_per_step,
        num_splits=num_splits,
        scale=scale,
        exact=exact,
        window=window,
        soft_cap=soft_cap,
        sinks=sinks is not None,
        chunk=chunk,
    )
    sink_width = decode_rows(group)  # a power of two >= group
    sink_rows = None if sinks is None else _sink_rows(sinks, num_heads, sink_width)
    q_spec, qr_spec = _latent_views(rows_spec, head_dim, latent)
    k_input, optional = _cache_inputs(
        k_cache,
        v_cache,
        blocks=blocks,
        latent=latent,
        sink=None
        if sinks is None
        else (pl.BlockSpec((None, sink_width), lambda t, h, k: (h, 0)), sink_rows),
        q_rope=None if latent is None else (qr_spec, q_rows),
    )
    kernel, in_specs, args = _with_inputs(
        kernel,
        [
            (_whole((max_tiles,)), tile_seq),
            (_whole((max_tiles,)), tile_row),
            (_whole((max_seqs,)), kv_lens),
            (_whole((max_seqs + 1,)), query_start_loc),
            (_whole((max_seqs * max_blocks,)), block_tables.reshape(-1)),
            (q_spec, q_rows),
            k_input,
        ],
        optional,
    )
    if num_splits == 1:
        out_specs = rows_spec(out_dim, 0)
        out_shape = jax.ShapeDtypeStruct((num_heads, padded, out_dim), q.dtype)
    else:  # per split: the unnormalised output rows and their softmax statistics
        out_specs, out_shape = _partial_outputs(
            (num_splits, num_heads, padded), lambda t, h, k: (k, h, 0), out_dim
        )
    result = pl.pallas_call(
        kernel,
        grid=(max_tiles, num_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_mixed",
    )(*args)
    merge_sink = None  # each row's (token, head-in-group) sink: [Hv, padded]
    if sinks is not None:
        merge_sink = jnp.tile(sink_rows[:, :group], (1, num_tokens + -(-q_block // group)))
        merge_sink = merge_sink[:, :padded]
    out = result if num_splits == 1 else merge_splits(*result, merge_sink).astype(q.dtype)

    out = out[:, :num_rows].reshape(num_heads, num_tokens, group, out_dim)
    return out.transpose(1, 0, 2, 3)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "attention_chunk",
        "decode_only",
        "decode_pages_per_step",
        "num_kv_splits",
        "q_block",
        "prefill_kv_tokens_per_step",
        "mixed_kv_splits",
        "num_warps",
        "num_stages",
        "smem_limit",
        "num_sms",
        "interpret",
        "latent_dim",
    ),
)
def ragged_paged_attention(
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
    attention_chunk: int | None = None,
    decode_only: bool = False,
    decode_pages_per_step: int | None = None,
    num_kv_splits: int | None = None,
    q_block: int = 64,
    prefill_kv_tokens_per_step: int | None = None,
    mixed_kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    smem_limit: int = HOPPER_SMEM_BYTES,
    num_sms: int | None = None,
    interpret: bool = False,
    latent_dim: int | None = None,
) -> jax.Array:
    """Causal attention of ragged queries over a paged KV cache (Pallas kernel).

    Args:
      q: [T, Hq, D] queries (rotary already applied); D a power of two.
      k_cache, v_cache: [num_blocks, block_size, Hkv, D]; Hq a multiple of Hkv; block_size a
        power of two.
      kv_lens: i32[S] cached tokens per sequence, the new ones included.
      block_tables: i32[S, max_blocks] block ids of each sequence, in order.
      query_start_loc: i32[S+1] row offsets of each sequence's queries in q.
      num_seqs: i32[1] number of real sequences; later entries are padding.
      sinks: [Hq] or None: attention sinks (gpt-oss), a logit per query head in each row's
        softmax denominator.
      sm_scale: softmax scale, usually head_dim ** -0.5.
      sliding_window: each query sees only the latest this many keys (its own included);
        pages before a program's window are skipped.
      attention_chunk: each query sees only the keys of its own chunk of this many
        positions (Llama 4); pages before a program's chunk are skipped.
      soft_cap: scores become soft_cap * tanh(score / soft_cap) (Gemma 2).
      decode_only: the caller promises every real sequence has one query token: only the
        decode kernel runs (otherwise the mixed kernel takes the multi-token sequences).
      decode_pages_per_step: KV pages per inner step of the decode kernel (default: 128
        tokens' worth, fewer where shared memory needs it: `plan_tiles`).
      num_kv_splits: programs a decode sequence's context is split across (merged after);
        default `plan_kv_splits` for this batch size, KV heads and num_sms.
      q_block: query rows (token x GQA head) per program of the mixed kernel; power of two.
      prefill_kv_tokens_per_step: keys per inner step of the mixed kernel (default 64, fewer
        where shared memory needs it).
      mixed_kv_splits: programs each query tile's keys are split across (merged after);
        default `plan_kv_splits` for the fewest tiles T tokens fill.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipeline stages (default 2, fewer if shared memory is short).
      smem_limit: shared memory per block in bytes (default Hopper's); tilings given
        explicitly are checked against it, defaults are fitted to it.
      num_sms: SMs the splits are planned for (default: the GPU's, else 132).
      interpret: run in Pallas interpret mode (CPU testing).
      latent_dim: multi-head latent attention (DeepSeek's MLA, absorbed form) with this
        kv_lora_rank r: D = r + the rotary width (both powers of two, r a multiple of it);
        each cache token is [latent; rotary key], the keys, and its latent is the value
        (v_cache is not read); Hkv is the latent's replicas. The query heads are split in
        blocks of MLA_HEADS, each block a program of its own.

    Returns:
      [T, Hq, D] in q's dtype (MLA: [T, Hq, r]); padding rows are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if latent_dim is not None and (sinks is not None or sliding_window or attention_chunk):
        raise ValueError("the MLA kernel has no sinks, sliding window or attention chunks")
    q, blocks = split_heads(q, num_kv_heads, None if latent_dim is None else MLA_HEADS)
    _, num_heads, group, _ = q.shape
    plan = plan_attention(  # K/V tiles at the wider of q's and the cache's widths (fp8 widened)
        (num_tokens, num_heads * group, head_dim),
        (*k_cache.shape[:2], num_heads, k_cache.shape[3]),
        block_tables.shape,
        decode_only=decode_only,
        q_block=q_block,
        latent=latent_dim,
        dtype=max(q.dtype, k_cache.dtype, key=lambda d: d.itemsize),
        num_sms=num_sms,
        decode_pages_per_step=decode_pages_per_step,
        num_kv_splits=num_kv_splits,
        prefill_kv_tokens_per_step=prefill_kv_tokens_per_step,
        mixed_kv_splits=mixed_kv_splits,
        num_stages=num_stages,
        smem_limit=smem_limit,
    )
    kv_lens = kv_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    num_seqs = num_seqs.astype(jnp.int32)
    common = dict(
        scale=sm_scale * _LOG2E,
        exact=q.dtype == jnp.float32,
        num_warps=num_warps,
        interpret=interpret,
        window=sliding_window,
        soft_cap=soft_cap,
        chunk=attention_chunk,
        blocks=blocks,
        latent=latent_dim,
    )
    out_dim = head_dim if latent_dim is None else latent_dim

    def merged(out):  # [T, Hv, g, Dv] -> [T, Hq, Dv]: the head blocks' padding dropped
        out = out.reshape(num_tokens, num_kv_heads, -1, out_dim)[
            :, :, : num_q_heads // num_kv_heads
        ]
        return out.reshape(num_tokens, num_q_heads, out_dim)

    single = decode_seqs(query_start_loc, num_seqs, decode_only=decode_only)
    rows, dest = _decode(  # sequences of no single-token row read nothing and write no row
        q,
        k_cache,
        v_cache,
        jnp.where(single, kv_lens, 0),
        block_tables,
        query_start_loc,
        sinks,
        num_splits=plan.num_kv_splits,
        num_stages=plan.decode.num_stages,
        pages_per_step=plan.decode.pages_per_step,
        **common,
    )
    zeros = jnp.zeros((num_tokens, num_heads, group, out_dim), q.dtype)
    if decode_only:  # rows of no sequence stay zero
        return merged(zeros.at[dest].set(rows, mode="drop"))
    mixed = _mixed(
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        sinks,
        q_block=q_block,
        num_splits=plan.mixed_kv_splits,
        num_stages=plan.mixed.num_stages,
        pages_per_step=plan.mixed.pages_per_step,
        **common,
    )
    # The mixed kernel wrote the multi-token sequences' rows; the rest hold garbage: padding
    # rows become zero (as the reference gives), the decode rows are written over in place.
    valid = jnp.arange(num_tokens) < query_start_loc[num_seqs[0]]
    out = jnp.where(valid[:, None, None, None], mixed, zeros)
    return merged(out.at[dest].set(rows, mode="drop"))
