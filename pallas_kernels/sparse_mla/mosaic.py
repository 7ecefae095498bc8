"""Sparse MLA as a Mosaic GPU kernel (Pallas, Hopper: TMA + wgmma) that reads only the listed
tokens' cache rows: `reference.sparse_mla_reference`'s contract and semantics, plus tuning
arguments and `interpret`.

Work. A work item is (query token, head tile, value half, split): a head tile is 64 of the
token's query heads (one warpgroup's wgmma M; fewer heads are padded, e.g. DeepSeek-V3.2's 16
per device at tp 8), all of which attend to the same token list; the value half is which 256
of the r = 512 output columns the item accumulates (a [64, 512] float32 accumulator is 256
registers a thread, more than a thread has; the Triton MLA kernel splits its heads for the
same reason). So the two halves' items read the same rows, the second mostly from L2: they
are adjacent work items and run side by side. A split is a share of the list's steps; the
float32 partials of several splits are merged in XLA (flash-decoding), as the paged kernel's
are. A persistent grid of one program per SM loops over the items pid, pid + grid, ...

A step is KEYS (64) listed tokens:
  1. Gather: one TMA per token, its whole cached head (`cache[slot, replica 0]`, 576 values
     viewed as [9, 64]: a TMA box dimension is at most 256) into a staging buffer [64, 9,
     64] in plain row-major order. TMA writes one dense box, and a single token's row of a
     wgmma operand's tiled, swizzled layout is not dense (an 8-row tile holds 8 tokens), so
     the rows cannot land in the operand's layout directly; Hopper's TMA has no gather.
     The slot of each token is a scalar read of the list in global memory.
  2. Re-layout: the warpgroup loads the staging buffer 64 columns at a time, whole 128-byte
     rows per load (Mosaic's smem-copy layout: no bank conflicts, where the wgmma layout's
     loads of rows 1152 bytes apart would conflict 8 ways), and stores them into the
     swizzled [64, 576] operand buffer; then the staging buffer is free and the next step's
     copies are issued, in flight while this step computes.
  3. S = Q K^T over all 576 columns (one wgmma, float32 accumulator), the scale (log2 e
     folded in), the tokens past the list's length masked, online softmax (exp2) in
     registers, O += P V with P in registers (q's dtype, the wgmma's A operand) and V the
     half's 256 columns of the same buffer.
The list's order is the caller's: valid slots first, -1 after them (`lax.top_k`'s order);
only the count of valid slots is read (a -1 among them would read slot 0 and count it).

Shared memory (bf16, 576 columns): q, staging and operand 72 KiB each, then, after the
loop in a scope that reuses the same bytes, the output tile (float32 64 KiB when split) and
its row statistics: 216 KiB of Hopper's 227.

Interpret mode (`interpret=True`, Mosaic GPU's interpreter on CPU) runs this kernel, except
where the interpreter lacks a feature: its wgmma takes no transposed operand (K^T goes
through a scratch buffer) and no A operand in registers (P goes through shared memory), it
has no layout casts or layout-aware loads (plain jnp there). This module raises ImportError
on a jax without Mosaic GPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu  # ImportError without Mosaic GPU

from pallas_kernels.paged_attention import mosaic_tiling
from pallas_kernels.paged_attention.mosaic import (
    _default_num_sms,
    _Ops,
    persistent_kernel,
    swizzled_smem,
)
from pallas_kernels.paged_attention.tiling import merge_splits

ROWS = 64  # head rows of a tile: one warpgroup's wgmma M
KEYS = 64  # listed tokens per step
CHUNK = 64  # columns per TMA box row and per re-layout load (a 128-byte swizzle of bf16)
HALF = 256  # value columns one item accumulates (the wgmma N)
_LOG2E = math.log2(math.e)
_M_INIT = -1e30


def smem_bytes(head_dim: int, itemsize: int, split: bool) -> int:
    """Shared memory of one compiled program: the loop's buffers (q, the staging rows, the
    operand) or the output's, whichever is more (they share the same bytes), plus the
    two barriers."""
    loop = (ROWS + 2 * KEYS) * head_dim * itemsize
    out = ROWS * HALF * (4 if split else itemsize) + 2 * ROWS * 4
    return max(loop, out) + 2 * 8


def _kernel(
    slots_ref,
    counts_ref,
    q_ref,
    cache_ref,
    *rest,
    steps_per_split: int,
    num_splits: int,
    num_programs: int,
    num_work: int,
    head_tiles: int,
    sm_scale: float,
    interpret: bool,
):
    """One program of the persistent grid.

    The barriers (the q tile's, the step's rows') live as long as the program: a wait
    consumes one phase, and every copy issued is waited for. GMEM refs: slots_ref
    i32[T * splits * steps_per_split * KEYS] (each token's list, padded per split),
    counts_ref i32[T] (valid entries), q_ref [T, tiles, 64, D], cache_ref [rows, R, D / 64,
    64]; the outputs (unsplit: o_ref [T, tiles, 2, 64, 256] in q's dtype; split: f32 o_ref
    [splits, T, tiles, 2, 64, 256], m_ref and l_ref [splits, T, tiles, 2, 64])."""
    *outs, q_bar, kv_bar = rest
    if num_splits == 1:
        (o_ref,), m_ref, l_ref = outs, None, None
    else:
        o_ref, m_ref, l_ref = outs
    ops = _Ops(interpret)
    head_dim = q_ref.shape[-1]
    chunks = head_dim // CHUNK
    dtype = q_ref.dtype
    list_len = num_splits * steps_per_split * KEYS
    pid = lax.axis_index("program")

    swizzled = functools.partial(swizzled_smem, dtype=dtype)

    def work_item(i, carry):
        w = pid + i * num_programs
        split = w % num_splits
        half = (w // num_splits) % 2
        tile = (w // (2 * num_splits)) % head_tiles
        token = w // (2 * num_splits * head_tiles)
        count = counts_ref[token]
        total = pl.cdiv(count, KEYS)
        num_steps = jnp.clip(total - split * steps_per_split, 0, steps_per_split)
        first = token * list_len + split * steps_per_split * KEYS  # this split's entries

        loop_scratch = [
            swizzled((ROWS, head_dim)),  # q
            plgpu.SMEM((KEYS, chunks, CHUNK), dtype),  # staging: the gathered rows
            swizzled((KEYS, head_dim)),  # the operand: the rows re-laid
            swizzled((head_dim, KEYS)) if interpret else None,  # K^T (interpreter only)
            swizzled((ROWS, KEYS)) if interpret else None,  # P (interpreter only)
        ]
        m, l, acc = pl.run_scoped(
            functools.partial(_attend, token, tile, half, first, count, num_steps, split),
            *loop_scratch,
        )
        out = (ROWS, HALF)
        o_type = plgpu.SMEM(out, dtype if num_splits == 1 else jnp.float32)
        rows_type = plgpu.SMEM((ROWS,), jnp.float32)
        pl.run_scoped(
            functools.partial(_store, token, tile, half, split, m, l, acc),
            o_type,
            rows_type,
            rows_type,
        )
        return carry

    def _attend(token, tile, half, first, count, num_steps, split, *scratch):
        q_smem, stage, kv_smem, kt_smem, p_smem = scratch
        plgpu.copy_gmem_to_smem(q_ref.at[token, tile], q_smem, q_bar)

        copy_layout = plgpu.Layout.SMEM_GMEM_COPY((KEYS, CHUNK), dtype, 128)

        def issue(step):
            """TMA step `step`'s listed rows into the staging buffer."""
            for p in range(KEYS):
                slot = jnp.maximum(slots_ref[first + step * KEYS + p], 0)
                plgpu.copy_gmem_to_smem(cache_ref.at[slot, 0], stage.at[p], kv_bar)

        pl.when(num_steps > 0)(functools.partial(issue, 0))
        plgpu.barrier_wait(q_bar)
        base = split * steps_per_split * KEYS  # the split's first list entry

        def step(j, carry):
            m, l, acc = carry
            plgpu.barrier_wait(kv_bar)
            for c in range(chunks):  # the staging rows into the operand's layout
                cols = pl.ds(c * CHUNK, CHUNK)
                if interpret:
                    kv_smem[:, cols] = stage[:, c]
                else:  # whole 128-byte rows a load: no bank conflicts on either side
                    kv_smem[:, cols] = plgpu.load(stage.at[:, c], (), layout=copy_layout)
            plgpu.commit_smem()

            @pl.when(j + 1 < num_steps)  # the staging buffer is free: the next step's rows
            def _():
                issue(j + 1)

            s = ops.scores(q_smem, kv_smem, kt_smem) * (sm_scale * _LOG2E)
            key = base + j * KEYS + ops.columns(s.shape)
            s = jnp.where(key < count, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            alpha = jnp.exp2(m - m_new)
            l = alpha * l + p.sum(axis=1)
            values = kv_smem.at[:, pl.ds(pl.multiple_of(half * HALF, HALF), HALF)]
            p = p.astype(dtype)
            if interpret:  # its wgmma takes A from shared memory only
                p_smem[...] = p
                p = p_smem
            pv = ops.values(p, values)  # compiled: P in registers, wgmma's A operand
            acc = lax.broadcast_in_dim(alpha, acc.shape, [0]) * acc + pv
            return m_new, l, acc

        init = (
            ops.rows(jnp.full((ROWS,), _M_INIT, jnp.float32)),
            ops.rows(jnp.zeros((ROWS,), jnp.float32)),
            ops.tile(jnp.zeros((ROWS, HALF), jnp.float32)),
        )
        return lax.fori_loop(0, num_steps, step, init)

    def _store(token, tile, half, split, m, l, acc, o_smem, m_smem, l_smem):
        if num_splits == 1:
            l = jnp.maximum(l, 1e-30)
            o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[token, tile, half])
        else:
            o_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, token, tile, half])
            plgpu.copy_smem_to_gmem(m_smem, m_ref.at[split, token, tile, half])
            plgpu.copy_smem_to_gmem(l_smem, l_ref.at[split, token, tile, half])
        # the next item's loop scope reuses these bytes
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    lax.fori_loop(0, pl.cdiv(num_work - pid, num_programs), work_item, None)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "latent_dim", "num_splits", "num_sms", "interpret")
)
def sparse_mla(
    q: jax.Array,
    cache: jax.Array,
    slots: jax.Array,
    *,
    sm_scale: float,
    latent_dim: int,
    num_splits: int | None = None,
    num_sms: int | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Attention of each query over its listed tokens (Mosaic GPU kernel, sm_90).

    Args:
      q: [T, H, D] absorbed queries, bf16 or f16; D a multiple of 64 (576 for DeepSeek).
      cache: [num_blocks, block_size, R, D] in q's dtype (replica 0 is read).
      slots: i32[T, K] each query's tokens as cache slots, the valid ones first and -1 after
        them (`lax.top_k`'s order); a row without any gives zeros.
      sm_scale: the softmax scale.
      latent_dim: r, the value width: 512 (two halves of 256).
      num_splits: programs each item's list is split across (default: two items per SM).
      num_sms: the persistent grid's size (default: the device's SMs, else 132).
      interpret: Mosaic GPU interpret mode (CPU testing): True or interpret parameters.

    Returns:
      f32[T, H, latent_dim], as the reference.
    """
    if q.dtype not in (jnp.bfloat16, jnp.float16) or cache.dtype != q.dtype:
        raise NotImplementedError(
            f"the Mosaic GPU sparse-MLA kernel takes bf16/f16 q and cache of one dtype (got q "
            f"{q.dtype}, cache {cache.dtype}): use sparse_mla_reference"
        )
    num_tokens, num_heads, head_dim = q.shape
    if latent_dim != 2 * HALF or head_dim % CHUNK or head_dim <= latent_dim:
        raise ValueError(
            f"the Mosaic GPU sparse-MLA kernel takes latent_dim {2 * HALF} and a head of a "
            f"multiple of {CHUNK} past it (got latent_dim={latent_dim}, head_dim={head_dim})"
        )
    list_steps = pl.cdiv(slots.shape[1], KEYS)
    head_tiles = pl.cdiv(num_heads, ROWS)
    items = num_tokens * head_tiles * 2
    sms = _default_num_sms() if num_sms is None else num_sms
    splits = num_splits or mosaic_tiling.plan_kv_splits(  # two items per SM
        num_tiles=items, num_kv_heads=1, max_steps=list_steps, num_sms=sms
    )
    steps_per_split = pl.cdiv(list_steps, splits)
    list_len = splits * steps_per_split * KEYS
    itemsize = jnp.dtype(q.dtype).itemsize
    need = smem_bytes(head_dim, itemsize, splits > 1)
    if need > mosaic_tiling.HOPPER_SMEM_BYTES:
        raise ValueError(
            f"the Mosaic GPU sparse-MLA kernel needs {need} B of shared memory at head_dim "
            f"{head_dim}; {mosaic_tiling.HOPPER_SMEM_BYTES} B are available"
        )

    counts = jnp.sum(slots >= 0, axis=1).astype(jnp.int32)
    padded = jnp.pad(slots.astype(jnp.int32), ((0, 0), (0, list_len - slots.shape[1])))
    q_tiles = jnp.pad(q, ((0, 0), (0, head_tiles * ROWS - num_heads), (0, 0)))
    q_tiles = q_tiles.reshape(num_tokens, head_tiles, ROWS, head_dim)
    rows = cache.reshape(-1, cache.shape[2], head_dim // CHUNK, CHUNK)
    f32 = jnp.float32
    part = (splits, num_tokens, head_tiles, 2, ROWS)
    if splits == 1:
        out_type = jax.ShapeDtypeStruct((num_tokens, head_tiles, 2, ROWS, HALF), q.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((*part, HALF), f32),
            jax.ShapeDtypeStruct(part, f32),
            jax.ShapeDtypeStruct(part, f32),
        )
    num_work = items * splits
    programs = mosaic_tiling.num_programs(num_work=num_work, num_sms=sms)
    kernel = functools.partial(
        _kernel,
        steps_per_split=steps_per_split,
        num_splits=splits,
        num_programs=programs,
        num_work=num_work,
        head_tiles=head_tiles,
        sm_scale=sm_scale,
        interpret=interpret is not False,
    )
    result = persistent_kernel(
        kernel,
        out_type=out_type,
        num_programs=programs,
        scratch=[plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=KEYS)],
        interpret=interpret,
        name="sparse_mla_mosaic",
    )(padded.reshape(-1), counts, q_tiles, rows)

    out = result.astype(f32) if splits == 1 else merge_splits(*result)  # [T, tiles, 2, 64, 256]
    out = out.transpose(0, 1, 3, 2, 4).reshape(num_tokens, head_tiles * ROWS, 2 * HALF)
    return out[:, :num_heads]
