"""Ragged paged attention as a Mosaic GPU kernel (Pallas, Hopper: TMA + wgmma).

Same signature and semantics as `reference.ragged_paged_attention_reference` (read its
docstring for the batch layout) plus keyword-only tuning arguments and `interpret`; an
alternative to the Triton-backend kernel of `kernel.py` for Hopper (sm_90) GPUs.

Layout. The query rows of a sequence are its (token, head of the GQA group) pairs, token
major. A *tile* is TILE_ROWS (64, one warpgroup's wgmma M) consecutive rows of one sequence
for one KV head: a decode (one token) is one tile, its G heads padded to 64 rows; a prefill
chunk of n tokens is ceil(n * G / 64) tiles. A small XLA prologue assigns tiles to sequences
from `query_start_loc`, gives each tile row its query position (-1: padding) and each tile
the key range its rows can see, and gathers the rows into q_tiles [tiles, Hkv, R, D] (every
TMA box of q then starts at a whole tile: jax 0.11's Mosaic GPU refuses a dynamic row offset
into a tiled shared-memory buffer that it cannot prove a multiple of the tiling). R is 64;
with `decode_only`, which bounds the tiles statically (one per sequence), a tile's rows past
its group are padding and only the group travels, R = G rounded up to 8 (in and out).
Decodes and prefill chunks go through the same kernel.

Grid. A work item is (tile, KV head, KV split); a persistent grid of `num_programs`
programs (one per SM) loops over the items pid, pid + grid, ... (a static round-robin; no
dynamic scheduling). Items of tiles past the batch exit at once.

What one work item does:
  1. TMA the tile's R query rows of its KV head (into the first R of the 64-row buffer; the
     rest, never written in a decode tile, are padding rows whose scores are all masked),
     the rows' positions (and sink logits) into shared memory.
  2. Stream the keys the tile can see (causal up to its last row, from the first row's
     sliding window on; with several splits, the split's share of the steps) in steps of
     `pages_per_step` whole pages. Each page is one TMA per operand: the [block_size, D]
     box `k_cache[block, :, kv_head, :]`, a strided slice of the engine's
     [num_blocks, block_size, Hkv, D] cache whose block id is a scalar read of the block
     table in global memory. The step's pages land side by side in one [keys, D] buffer and
     arrive on one barrier (one arrival per page). `num_stages` steps are in flight: the
     copies for step j + stages are issued once step j's buffers have been consumed.
  3. Per step: S = Q K^T (wgmma, f32 accumulator), scale (log2 e folded in), soft cap,
     causal / window mask from the rows' positions, online softmax (exp2) in registers; P
     goes to shared memory in q's dtype and O += P V (wgmma).
  4. Unsplit: normalise (sinks join the denominator here) and TMA the tile's first R rows
     to its own output slot [tiles, Hkv, R, D] in q's dtype. Split: TMA the float32 partial
     (unnormalised O, max, sum) to [splits, tiles, Hkv, R(, D)]; XLA merges the splits
     (flash-decoding) and adds the sinks.
  Tiles write whole slots of their own, so no two programs write the same rows; XLA then
  gathers each (token, head)'s row back into [T, Hq, D] (padding rows zero). An unsplit
  decode skips both gathers (the direct path, `direct_rows`): each item copies its group's
  rows straight from q's [T * Hq] rows (from the 8-row boundary at or before them) and stores
  its output rows straight into the result; padding tokens' tiles store zeros. Sinks there
  (Hq a multiple of 8) come from the sinks wrapped around, [Hq + 64], at the first row's head.
  A split decode reads q the same way; its partials are merged where the kernel wrote them
  and each group's rows gathered from its tile (`_direct`).

Why these choices: a tile's rows come from one sequence, so its pages are shared by all its
rows (GQA heads share each page load); TMA boxes must be rectangular with static shapes,
hence per-page copies with a dynamic block index rather than a gathered tile; the masked
store ladder a ragged tile would need is avoided by per-tile output slots.

Numerics: the dots take q's dtype (bf16 / f16) with float32 accumulation, the softmax is
float32. float32 inputs are refused (Hopper's wgmma would run them as tf32, below the
reference's float32 accuracy): use `kernel.py`. Neither attention_chunk (Llama 4) nor the MLA
variant (`latent_dim`) is implemented here: both raise NotImplementedError naming the Triton
kernel. The tiling arithmetic lives in `mosaic_tiling.py`.

Interpret mode (`interpret=True`: Mosaic GPU's interpreter, on CPU) runs this same kernel,
except where the interpreter lacks a feature: its wgmma takes no transposed operand, so K^T
goes through a scratch buffer; it has no layout casts or layout-aware loads, so those are
plain jnp there. This module raises ImportError on a jax without Mosaic GPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu  # ImportError without Mosaic GPU

from pallas_kernels.paged_attention import mosaic_tiling
from pallas_kernels.paged_attention.mosaic_tiling import HOPPER_SMEM_BYTES, TILE_ROWS
from pallas_kernels.paged_attention.tiling import merge_splits

_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite "minus infinity": rows without keys stay finite and give 0


def interpret_params(**kw: Any) -> Any:
    """Mosaic GPU interpret-mode parameters (kw: their fields, e.g. detect_races); their
    class moved between jax releases."""
    params = getattr(plgpu, "InterpretGPUParams", None) or getattr(plgpu, "InterpretParams", None)
    if params is None:  # jax 0.10: not yet public
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params(**kw)


def _interpret_arg(interpret: Any) -> Any:
    """`interpret` as plgpu.kernel takes it: True -> default interpret parameters, False ->
    None (compile); interpret parameters pass through."""
    if isinstance(interpret, bool):
        return interpret_params() if interpret else None
    return interpret


def persistent_kernel(
    body,
    *,
    out_type,
    num_programs: int,
    scratch,
    interpret: Any,
    name: str | None = None,
    **compiler_params: Any,
):
    """`body` as a Mosaic GPU kernel on a persistent grid of num_programs programs (axis
    "program": each loops over its share of the work items), exact math (no approximate
    exp), interpreted where `interpret` says (True, or interpret parameters); the kernels of
    this package and of sparse_mla / grouped_matmul launch this way."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_programs,),
        grid_names=("program",),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=False, **compiler_params),
        interpret=_interpret_arg(interpret),
        kernel_name=name,
    )


def _default_num_sms() -> int:
    device = jax.devices()[0]
    if device.platform == "gpu":
        return int(getattr(device, "core_count", 0) or mosaic_tiling.HOPPER_NUM_SMS)
    return mosaic_tiling.HOPPER_NUM_SMS


def swizzled_smem(shape: tuple[int, ...], dtype) -> Any:
    """A shared-memory buffer laid out as a wgmma operand: tiles of 8 rows, swizzled by the
    widest swizzle (up to 128 bytes) its rows' bytes allow."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


class _Ops:
    """The few operations whose form differs between compiled and interpreted kernels."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def rows(self, x):  # a [64] vector in the layout of the wgmma accumulator's rows
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))

    def tile(self, x):  # a [64, N] array in the wgmma accumulator's layout
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)

    def load_rows(self, ref):  # [64] from shared memory, in the rows' layout
        if self.interpret:
            return ref[...]
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))

    def columns(self, shape):  # i32 iota along axis 1 in the accumulator's layout
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, 1)
        return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)

    def row_ids(self, shape):  # i32 iota along axis 0 in the accumulator's layout
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, 0)
        return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)

    def scores(self, q_smem, k_smem, kt_smem):
        """Q K^T: [64, D] x [keys, D] -> f32 [64, keys]."""

        def qk(acc_ref):
            if self.interpret:  # the interpreter's wgmma takes no transposed operand
                kt_smem[...] = k_smem[...].T
                plgpu.wgmma(acc_ref, q_smem, kt_smem)
            else:
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
            return acc_ref[...]

        return pl.run_scoped(qk, plgpu.ACC((q_smem.shape[0], k_smem.shape[0]), jnp.float32))

    @staticmethod
    def values(p_smem, v_smem):
        """P V: [64, keys] x [keys, D] -> f32 [64, D]."""

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem)
            return acc_ref[...]

        return pl.run_scoped(pv, plgpu.ACC((p_smem.shape[0], v_smem.shape[1]), jnp.float32))


def _kernel(
    tile_seq_ref,
    tile_keys_ref,
    map_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    pos_ref,
    *rest,
    max_blocks: int,
    pages_per_step: int,
    num_stages: int,
    num_splits: int,
    num_programs: int,
    num_work: int,
    sm_scale: float,
    window: int | None,
    soft_cap: float | None,
    sinks: bool,
    interpret: bool,
    direct: bool = False,
    group: int = 0,
):
    """One program of the persistent grid (see the module docstring).

    GMEM refs: tile_seq_ref i32[tiles] (-1: no sequence); tile_keys_ref i32[2 * tiles]: the
    first key any row of the tile may see and the keys its last row sees; map_ref i32[2]
    (scale, shift: a table entry b is block b * scale + shift); tables_ref i32[S *
    max_blocks]; q_ref [tiles, Hkv, R, D]; k_ref, v_ref [num_blocks, block_size,
    Hkv, D]; pos_ref i32[tiles, 64]; then sink_ref f32[tiles, Hkv, 64] (when
    `sinks`, unsplit only; direct: f32[Hq + 64], the sinks in log2 units wrapped around),
    the outputs (unsplit: o_ref [tiles, Hkv, R, D] in q's dtype;
    split: o_ref f32[splits, tiles, Hkv, R, D], m_ref and l_ref f32[splits, tiles, Hkv,
    R]) and the scratch buffers (shared memory and barriers).

    `direct` (decode only): q_ref (and, unsplit, o_ref) are the caller's [T * Hq, D]
    rows, pos_ref i32[tiles] is each tile's first row there (its token's, -1: none), and a
    tile whose sequence is -1 but has a token writes zeros to its rows (unsplit; see
    `_direct_tiles`)."""
    rest = list(rest)
    sink_ref = rest.pop(0) if sinks else None
    if num_splits == 1:
        (o_ref,), m_ref, l_ref = rest[:1], None, None
        rest = rest[1:]
    else:
        o_ref, m_ref, l_ref = rest[:3]
        rest = rest[3:]
    (
        q_smem,
        k_smem,
        v_smem,
        p_smem,
        o_smem,
        pos_smem,
        sink_smem,
        m_smem,
        l_smem,
        kt_smem,
        q_bar,
        k_bars,
        v_bars,
    ) = rest
    ops = _Ops(interpret)
    num_blocks, block_size, num_kv_heads, head_dim = k_ref.shape
    keys = pages_per_step * block_size
    pid = lax.axis_index("program")

    def work_item(i, carry):
        w = pid + i * num_programs
        split = w % num_splits
        head = (w // num_splits) % num_kv_heads
        tile = w // (num_splits * num_kv_heads)
        seq = tile_seq_ref[tile]

        @pl.when(seq >= 0)
        def _():
            _attend_tile(tile, head, split, seq)

        if direct and num_splits == 1:  # a padding token's rows are zeros

            @pl.when((seq < 0) & (pos_ref[tile] >= 0))
            def _():
                o_smem[...] = jnp.zeros(o_smem.shape, o_smem.dtype)
                plgpu.commit_smem()
                rows = pl.ds(pos_ref[tile] + head * group, group)
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[rows])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        return carry

    # 64, or a decode tile's group rounded up to 8 rows (direct: from the 8-row boundary)
    q_rows = direct_rows(group) if direct else q_ref.shape[2]

    def first_rows(ref):  # the tile's rows that travel (the rest of a decode tile is padding)
        return ref if q_rows == TILE_ROWS else ref.at[pl.ds(0, q_rows)]

    def _attend_tile(tile, head, split, seq):
        if direct:  # q_rows of q from the 8-row boundary at or before the group's first
            row0 = pos_ref[tile] + head * group
            start = pl.multiple_of(direct_start(row0, q_ref.shape[0], q_rows), 8)
            shift = row0 - start  # the group's first row in the tile
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(start, q_rows)], first_rows(q_smem), q_bar)
        else:
            plgpu.copy_gmem_to_smem(q_ref.at[tile, head], first_rows(q_smem), q_bar)
            plgpu.copy_gmem_to_smem(pos_ref.at[tile], pos_smem, q_bar)
        if sinks and direct:  # the rows' query heads: from start's, modulo Hq (8-aligned)
            first_head = pl.multiple_of(lax.rem(start, sink_ref.shape[0] - TILE_ROWS), 8)
            plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(first_head, TILE_ROWS)], sink_smem, q_bar)
        elif sinks:
            plgpu.copy_gmem_to_smem(sink_ref.at[tile, head], sink_smem, q_bar)

        # The keys the tile sees: from its first row's window to its last row's position.
        first_page = tile_keys_ref[2 * tile] // block_size
        num_pages = jnp.maximum(pl.cdiv(tile_keys_ref[2 * tile + 1], block_size) - first_page, 0)
        total_steps = pl.cdiv(num_pages, pages_per_step)
        num_steps = total_steps
        if num_splits > 1:  # this split's share of the steps
            per_split = pl.cdiv(total_steps, num_splits)
            first_page = first_page + split * per_split * pages_per_step
            num_steps = jnp.clip(total_steps - split * per_split, 0, per_split)

        def issue(step, slot):
            """TMA step `step`'s pages of K and V into buffer `slot`."""
            for p in range(pages_per_step):
                column = jnp.minimum(first_page + step * pages_per_step + p, max_blocks - 1)
                entry = tables_ref[seq * max_blocks + column] * map_ref[0] + map_ref[1]
                block = jnp.clip(entry, 0, num_blocks - 1)
                rows = pl.ds(p * block_size, block_size)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[block, :, head], k_smem.at[slot, rows], k_bars.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    v_ref.at[block, :, head], v_smem.at[slot, rows], v_bars.at[slot]
                )

        for s in range(num_stages):  # the pipeline's prologue
            pl.when(s < num_steps)(functools.partial(issue, s, s))

        plgpu.barrier_wait(q_bar)
        if direct:  # the group's rows see up to their token's position, the others nothing
            row = ops.row_ids((TILE_ROWS, keys))
            mine = (row >= shift) & (row < shift + group)
            pos2 = jnp.where(mine, tile_keys_ref[2 * tile + 1] - 1, -1)
        else:
            pos = ops.load_rows(pos_smem)  # i32[64]: each row's position, -1 for padding
            pos2 = lax.broadcast_in_dim(pos, (TILE_ROWS, keys), [0])

        def step(j, carry):
            m, l, acc = carry
            slot = lax.rem(j, num_stages)
            plgpu.barrier_wait(k_bars.at[slot])
            s = ops.scores(q_smem, k_smem.at[slot], kt_smem) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = s * _LOG2E
            key = (first_page + j * pages_per_step) * block_size + ops.columns(s.shape)
            seen = key <= pos2
            if window is not None:
                seen = seen & (key > pos2 - window)
            s = jnp.where(seen, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            alpha = jnp.exp2(m - m_new)
            l = alpha * l + p.sum(axis=1)
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bars.at[slot])
            pv = ops.values(p_smem, v_smem.at[slot])
            acc = lax.broadcast_in_dim(alpha, acc.shape, [0]) * acc + pv

            @pl.when(j + num_stages < num_steps)  # the slot is free: refill it
            def _():
                issue(j + num_stages, slot)

            return m_new, l, acc

        init = (
            ops.rows(jnp.full((TILE_ROWS,), _M_INIT, jnp.float32)),
            ops.rows(jnp.zeros((TILE_ROWS,), jnp.float32)),
            ops.tile(jnp.zeros((TILE_ROWS, head_dim), jnp.float32)),
        )
        m, l, acc = lax.fori_loop(0, num_steps, step, init)

        if num_splits == 1:
            if sinks:  # one more logit in each row's denominator
                sink = ops.load_rows(sink_smem)
                m_all = jnp.maximum(m, sink)
                alpha = jnp.exp2(m - m_all)
                l = alpha * l + jnp.exp2(sink - m_all)
                acc = lax.broadcast_in_dim(alpha, acc.shape, [0]) * acc
            l = jnp.maximum(l, 1e-30)
            o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_smem.dtype)
            plgpu.commit_smem()
            if direct:  # the group's rows alone, to their rows of the output
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(shift, group)], o_ref.at[pl.ds(row0, group)]
                )
            else:
                plgpu.copy_smem_to_gmem(first_rows(o_smem), o_ref.at[tile, head])
        else:
            o_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(first_rows(o_smem), o_ref.at[split, tile, head])
            plgpu.copy_smem_to_gmem(first_rows(m_smem), m_ref.at[split, tile, head])
            plgpu.copy_smem_to_gmem(first_rows(l_smem), l_ref.at[split, tile, head])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem is reused by the next item

    lax.fori_loop(0, pl.cdiv(num_work - pid, num_programs), work_item, None)
    plgpu.wait_smem_to_gmem(0)


class _Tiles(NamedTuple):
    """The tiles of one call (the XLA prologue's output; `tiles` is a static bound)."""

    seq: jax.Array  # i32[tiles]: each tile's sequence, -1 past the batch
    keys: jax.Array  # i32[tiles, 2]: first key any row may see, keys its last row sees
    row_pos: jax.Array  # i32[tiles, 64]: each row's position, -1 for padding rows
    row_token: jax.Array  # i32[tiles, 64]: each row's token (clamped for padding rows)
    row_head: jax.Array  # i32[tiles, 64]: each row's head within the GQA group
    out_tile: jax.Array  # i32[T, G]: the tile each (token, head of group) row is in
    out_row: jax.Array  # i32[T, G]: and its row in the tile
    token_real: jax.Array  # bool[T]: tokens of a sequence the kernel attends


def _prologue(
    query_start_loc, num_seqs, kv_lens, *, num_tokens, group, num_tiles, window, decode_only
) -> _Tiles:
    """Assign tiles to sequences, in XLA: sequence s of q_len tokens gets ceil(q_len * G /
    64) tiles of its rows (token, head of group), in order."""
    max_seqs = query_start_loc.shape[0] - 1
    real = jnp.arange(max_seqs) < num_seqs[0]
    q_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)
    if decode_only:  # as the reference: only single-token sequences are attended
        q_lens = jnp.where(q_lens == 1, 1, 0)
    tiles = (q_lens * group + TILE_ROWS - 1) // TILE_ROWS
    ends = jnp.cumsum(tiles)
    starts = ends - tiles
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, ids, side="right"), max_seqs - 1).astype(jnp.int32)
    used = ids < ends[-1]
    row = (ids - starts[seq])[:, None] * TILE_ROWS + jnp.arange(TILE_ROWS)  # in its sequence
    tok = row // group
    q_len, kv_len = q_lens[seq][:, None], kv_lens[seq][:, None]
    valid = used[:, None] & (tok < q_len)
    row_pos = jnp.where(valid, kv_len - q_len + tok, -1)
    first_pos = (kv_len - q_len + tok)[:, 0]
    first_key = jnp.zeros_like(first_pos) if window is None else first_pos - window + 1
    keys = jnp.stack([jnp.maximum(first_key, 0), jnp.max(row_pos, axis=1) + 1], axis=1)
    row_token = jnp.clip(query_start_loc[seq][:, None] + tok, 0, num_tokens - 1)

    # Where each (token, head) row went: its sequence, tile and row in the tile.
    token = jnp.arange(num_tokens)
    tseq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right"), max_seqs - 1)
    t_row = (token - query_start_loc[tseq])[:, None] * group + jnp.arange(group)  # [T, G]
    out_tile = jnp.minimum(starts[tseq][:, None] + t_row // TILE_ROWS, num_tiles - 1)
    token_real = (token < query_start_loc[num_seqs[0]]) & (q_lens[tseq] > 0)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return _Tiles(
        jnp.where(used, seq, -1),
        i32(keys),
        i32(row_pos),
        i32(row_token),
        i32(row % group),
        i32(out_tile),
        i32(t_row % TILE_ROWS),
        token_real,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "attention_chunk",
        "decode_only",
        "kv_tokens_per_step",
        "num_stages",
        "num_kv_splits",
        "num_sms",
        "smem_limit",
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
    block_map: jax.Array | None = None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    attention_chunk: int | None = None,
    decode_only: bool = False,
    kv_tokens_per_step: int | None = None,
    num_stages: int | None = None,
    num_kv_splits: int | None = None,
    num_sms: int | None = None,
    smem_limit: int = HOPPER_SMEM_BYTES,
    interpret: Any = False,
    latent_dim: int | None = None,
) -> jax.Array:
    """Causal attention of ragged queries over a paged KV cache (Mosaic GPU kernel, sm_90).

    Args:
      q: [T, Hq, D] queries (rotary applied), bf16 or f16; D a multiple of 64.
      k_cache, v_cache: [num_blocks, block_size, Hkv, D] in q's dtype; Hq a multiple of
        Hkv; block_size a power of two from 8 to 256.
      kv_lens: i32[S] cached tokens per sequence, the new ones included.
      block_tables: i32[S, max_blocks] block ids of each sequence, in order.
      query_start_loc: i32[S+1] row offsets of each sequence's queries in q.
      num_seqs: i32[1] number of real sequences; later entries are padding.
      sinks: [Hq] or None: a logit per query head in each row's softmax denominator.
      block_map: i32[2] (scale, shift) or None: the cache's block of table entry b is
        b * scale + shift (a layer's share of a cache of several layers, read without an
        XLA pass over the tables; None: b).
      sm_scale: softmax scale, usually head_dim ** -0.5.
      sliding_window: each query sees only the latest this many keys (its own included);
        pages before a tile's window are not read.
      soft_cap: scores become soft_cap * tanh(score / soft_cap).
      attention_chunk: not implemented here (NotImplementedError): use kernel.py's.
      decode_only: the caller promises every real sequence has one query token (one tile
        each; others get zero rows, as the reference's decode-only path).
      kv_tokens_per_step: keys per pipeline step, whole pages (default 64: `mosaic_tiling`).
      num_stages: pipeline steps in flight (default: as many as fit, at most 4).
      num_kv_splits: programs each tile's keys are split across (default: enough to give
        every SM two work items; 1 when the tiles fill them).
      num_sms: SMs of the GPU (default: the device's, else 132); the persistent grid's size.
      smem_limit: shared memory per block in bytes the tiling must fit.
      interpret: run in Mosaic GPU interpret mode (CPU testing): True, or interpret
        parameters (`interpret_params(detect_races=True)`, hashable).
      latent_dim: MLA is not implemented here (NotImplementedError): use kernel.py's.

    Returns:
      [T, Hq, D] in q's dtype; padding rows are zero.
    """
    if attention_chunk is not None or latent_dim is not None:
        what = "attention_chunk" if attention_chunk is not None else "MLA (latent_dim)"
        raise NotImplementedError(
            f"the Mosaic GPU paged-attention kernel has no {what}: use "
            "pallas_kernels.paged_attention.kernel.ragged_paged_attention (Triton backend)"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_cache.dtype != q.dtype:
        raise NotImplementedError(
            f"the Mosaic GPU paged-attention kernel takes bf16/f16 q and cache of the same "
            f"dtype (got q {q.dtype}, cache {k_cache.dtype}; float32 would run as tf32): use "
            "pallas_kernels.paged_attention.kernel.ragged_paged_attention (Triton backend)"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_seqs, max_blocks = block_tables.shape
    itemsize = jnp.dtype(q.dtype).itemsize
    plan = mosaic_tiling.plan(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_seqs=max_seqs,
        max_blocks=max_blocks,
        itemsize=itemsize,
        decode_only=decode_only,
        kv_tokens=kv_tokens_per_step,
        num_stages=num_stages,
        num_kv_splits=num_kv_splits,
        num_sms=_default_num_sms() if num_sms is None else num_sms,
        smem_limit=smem_limit,
    )
    group = num_q_heads // num_kv_heads
    num_tiles = mosaic_tiling.max_tiles(
        num_tokens=num_tokens, group=group, max_seqs=max_seqs, decode_only=decode_only
    )
    splits = plan.num_kv_splits
    rows = TILE_ROWS if not decode_only else min(TILE_ROWS, -(-group // 8) * 8)
    if block_map is None:
        block_map = jnp.array([1, 0], jnp.int32)
    block_map = block_map.astype(jnp.int32)
    tables = block_tables.astype(jnp.int32).reshape(-1)
    # A decode batch of one split reads its query rows from q and writes its output rows in
    # place: no XLA gather on either side (whole 8-row tiles of q from the boundary at or
    # before the group's first row: `direct_rows`).
    lens = (
        query_start_loc.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
    )
    static = dict(
        max_blocks=max_blocks, sm_scale=sm_scale, window=sliding_window, soft_cap=soft_cap
    )
    if (
        decode_only
        and (sinks is None or num_q_heads % 8 == 0)
        and direct_fits(num_tokens * num_q_heads, group)
    ):
        num_tiles = max(num_tiles, num_tokens)  # every token's rows written, padding zeros
        direct = _direct_tiles(
            *lens,
            num_tokens=num_tokens,
            num_q_heads=num_q_heads,
            num_tiles=num_tiles,
            window=sliding_window,
        )
        args = (q, k_cache, v_cache, block_map, tables, sinks, direct, plan, interpret)
        return _direct(*args, group=group, static=static)

    tiles = _prologue(
        *lens,
        num_tokens=num_tokens,
        group=group,
        num_tiles=num_tiles,
        window=sliding_window,
        decode_only=decode_only,
    )
    # Each tile's query rows per KV head, [tiles, Hkv, R, D], gathered in XLA so every TMA
    # box of q starts at a whole tile. R = 64, but a decode tile's rows past its group are
    # padding: there only the group, rounded up to whole 8-row tiles of shared memory,
    # travels (in and out: 1/8 of the bytes for a group of 4).
    heads = jnp.arange(num_kv_heads)[None, :, None]
    q_groups = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_tiles = q_groups[tiles.row_token[:, None, :rows], heads, tiles.row_head[:, None, :rows]]
    tile_sinks = None  # each tile row's sink logit (log2 units), [tiles, Hkv, 64]
    if sinks is not None:
        sink_log2 = sinks.astype(jnp.float32).reshape(num_kv_heads, group) * _LOG2E
        tile_sinks = sink_log2[:, tiles.row_head].transpose(1, 0, 2)
    inputs = [
        tiles.seq,
        tiles.keys.reshape(-1),
        block_map,
        tables,
        q_tiles,
        k_cache,
        v_cache,
        tiles.row_pos,
    ]
    in_kernel_sinks = sinks is not None and splits == 1
    if in_kernel_sinks:
        inputs.append(tile_sinks)

    f32 = jnp.float32
    if splits == 1:
        out_type = jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), q.dtype)
    else:
        part = (splits, num_tiles, num_kv_heads, rows)
        out_type = (
            jax.ShapeDtypeStruct((*part, head_dim), f32),
            jax.ShapeDtypeStruct(part, f32),
            jax.ShapeDtypeStruct(part, f32),
        )
    work = num_tiles * num_kv_heads * splits
    result = _launch(
        inputs,
        out_type,
        plan,
        q,
        work,
        interpret,
        **static,
        num_splits=splits,
        sinks=in_kernel_sinks,
    )

    if splits > 1:  # merged where the kernel wrote them (no gathers of the partial results)
        sink_rows = None if tile_sinks is None else tile_sinks[..., :rows]
        result = merge_splits(*result, sink_rows)  # [tiles, Hkv, R, D]
    tile_idx, row_idx = tiles.out_tile[:, None, :], tiles.out_row[:, None, :]  # [T, 1, G]
    out = result[tile_idx, heads, row_idx]  # [T, Hkv, G, D]
    out = jnp.where(tiles.token_real[:, None, None, None], out, 0).astype(q.dtype)
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _direct(
    q, k_cache, v_cache, block_map, tables, sinks, direct, plan, interpret, *, group, static
) -> jax.Array:
    """A decode batch on the direct path (`direct`: _direct_tiles' arrays): each item reads
    its group's rows of q's [T * Hq] rows in place. Unsplit, it writes its output rows in
    place too; split, its float32 partials [splits, tiles, Hkv, R(, D)] (R = direct_rows: from
    the 8-row boundary at or before the group), merged where they are and then gathered."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, splits = k_cache.shape[2], plan.num_kv_splits
    seq, keys, first_row = direct
    q_rows = q.reshape(num_tokens * num_q_heads, head_dim)
    inputs = [seq, keys, block_map, tables, q_rows, k_cache, v_cache, first_row]
    wrapped = None
    if sinks is not None:  # a tile's rows from q row `start` take sinks[start % Hq + r]
        wrapped = (
            sinks.astype(jnp.float32)[jnp.arange(num_q_heads + TILE_ROWS) % num_q_heads] * _LOG2E
        )
    if sinks is not None and splits == 1:
        inputs.append(wrapped)
    num_tiles, rows = seq.shape[0], direct_rows(group)
    kw = dict(num_splits=splits, sinks=sinks is not None and splits == 1, direct=True, group=group)
    work = num_tiles * num_kv_heads * splits
    if splits == 1:
        out_type = jax.ShapeDtypeStruct(q_rows.shape, q.dtype)
        result = _launch(inputs, out_type, plan, q, work, interpret, **static, **kw)
        return result.reshape(num_tokens, num_q_heads, head_dim)
    part = (splits, num_tiles, num_kv_heads, rows)
    f32 = jnp.float32
    out_type = (
        jax.ShapeDtypeStruct((*part, head_dim), f32),
        jax.ShapeDtypeStruct(part, f32),
        jax.ShapeDtypeStruct(part, f32),
    )
    result = _launch(inputs, out_type, plan, q, work, interpret, **static, **kw)
    # where each (tile, KV head)'s rows started in q (as the kernel placed them)
    row0 = first_row[:, None] + jnp.arange(num_kv_heads)[None, :] * group  # [tiles, Hkv]
    start = direct_start(row0, num_tokens * num_q_heads, rows)
    sink_rows = None
    if wrapped is not None:  # [tiles, Hkv, R]
        sink_rows = wrapped[(start % num_q_heads)[..., None] + jnp.arange(rows)]
    merged = merge_splits(*result, sink_rows)  # [tiles, Hkv, R, D]
    # each real token's tile (its sequence's), and its group's rows in it
    tile = jnp.full((num_tokens,), -1, jnp.int32)
    tile = tile.at[jnp.where(seq >= 0, first_row // num_q_heads, num_tokens)].set(
        jnp.arange(num_tiles, dtype=jnp.int32), mode="drop"
    )
    t = jnp.maximum(tile, 0)[:, None, None]
    h = jnp.arange(num_kv_heads)[None, :, None]
    shift = (row0 - start)[t, h]  # [T, Hkv, 1]
    out = merged[t, h, shift + jnp.arange(group)]  # [T, Hkv, G, D]
    out = jnp.where((tile >= 0)[:, None, None, None], out, 0).astype(q.dtype)
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _launch(inputs, out_type, plan, q, num_work, interpret, **static) -> Any:
    """The kernel over `inputs` (its shared memory and barriers from `plan`); static: the
    rest of _kernel's keyword arguments."""
    f32, splits, stages = jnp.float32, static["num_splits"], plan.num_stages
    head_dim, block_size = q.shape[-1], inputs[5].shape[1]
    keys = plan.pages_per_step * block_size
    q_arrivals = (1 if static.get("direct") else 2) + static["sinks"]
    scratch = [
        swizzled_smem((TILE_ROWS, head_dim), q.dtype),  # q
        swizzled_smem((stages, keys, head_dim), q.dtype),  # k
        swizzled_smem((stages, keys, head_dim), q.dtype),  # v
        swizzled_smem((TILE_ROWS, keys), q.dtype),  # p
        plgpu.SMEM((TILE_ROWS, head_dim), q.dtype if splits == 1 else f32),  # o
        plgpu.SMEM((TILE_ROWS,), jnp.int32),  # row positions
        plgpu.SMEM((TILE_ROWS,), f32),  # sinks
        plgpu.SMEM((TILE_ROWS,), f32),  # m
        plgpu.SMEM((TILE_ROWS,), f32),  # l
        swizzled_smem((head_dim, keys), q.dtype) if interpret else None,  # K^T (interpreter only)
        plgpu.Barrier(num_arrivals=q_arrivals),
        plgpu.Barrier(num_arrivals=plan.pages_per_step, num_barriers=stages),
        plgpu.Barrier(num_arrivals=plan.pages_per_step, num_barriers=stages),
    ]
    kernel = functools.partial(
        _kernel,
        pages_per_step=plan.pages_per_step,
        num_stages=stages,
        num_programs=plan.num_programs,
        num_work=num_work,
        interpret=interpret is not False,
        **static,
    )
    return persistent_kernel(
        kernel,
        out_type=out_type,
        num_programs=plan.num_programs,
        scratch=scratch,
        interpret=interpret,
        name="ragged_paged_attention_mosaic",
    )(*inputs)


def direct_rows(group: int) -> int:
    """The q rows a direct decode tile copies: whole 8-row tiles of shared memory from the
    8-row boundary at or before its group's first row (Mosaic GPU copies a tiled buffer
    from tile-aligned rows), enough for the group wherever it starts."""
    return -(-(group + 8 - math.gcd(group, 8)) // 8) * 8


def direct_start(row0, total_rows: int, rows: int):
    """The first of the `rows` q rows a direct tile copies for a group starting at q row
    row0 (of total_rows): the 8-row boundary at or before it, or, at q's end, the last
    `rows` rows (the kernel's copy and the split merge's gather agree on it)."""
    return jnp.minimum(row0 // 8 * 8, total_rows - rows)


def direct_fits(q_rows: int, group: int) -> bool:
    """Whether a decode of q_rows = T * Hq rows of q, GQA groups of `group`, can take the
    direct path (whole 8-row tiles of q, at most one wgmma tile of them)."""
    return q_rows % 8 == 0 and direct_rows(group) <= min(TILE_ROWS, q_rows)


def _direct_tiles(
    query_start_loc, num_seqs, kv_lens, *, num_tokens, num_q_heads, num_tiles, window
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode batch's tiles for the direct path, tile i for sequence i: (seq i32[tiles]:
    i when the sequence is real and has one token, else -1; keys i32[2 * tiles]: the first
    key its row may see and its keys; first_row i32[tiles]: its token's first row of q's
    [T * Hq] rows, or for a tile of no sequence the padding token i's, else -1 (its rows are
    written zeros)."""
    max_seqs = query_start_loc.shape[0] - 1
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    s = jnp.minimum(ids, max_seqs - 1)
    q_len = query_start_loc[s + 1] - query_start_loc[s]
    attend = (ids < num_seqs[0]) & (ids < max_seqs) & (q_len == 1)
    # Padding tokens: those after the last sequence's (tokens of a sequence of several,
    # which decode_only excludes, are left alone: its rows may be another tile's)
    padding = (ids >= num_seqs[0]) & (ids >= query_start_loc[num_seqs[0]]) & (ids < num_tokens)
    token = jnp.where(attend, query_start_loc[s], ids)
    first_row = jnp.where(attend | padding, token * num_q_heads, -1)
    kv_len = jnp.where(attend, kv_lens[s], 0)
    first = jnp.zeros_like(kv_len) if window is None else jnp.maximum(kv_len - window, 0)
    keys = jnp.stack([first, kv_len], axis=1).reshape(-1)
    return jnp.where(attend, ids, -1), keys, first_row
