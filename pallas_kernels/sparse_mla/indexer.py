"""DeepSeek Sparse Attention's lightning-indexer scores as a Mosaic GPU kernel (Pallas,
Hopper: TMA + wgmma): for each query, every visible cached token's score
sum_h relu(q_h . k) w_h, read page by page from the paged index-key cache. The top-k stays
in XLA (reference.py's `index_logits_reference` is the same scores in jnp, its oracle).

Work. A work item is (query, split of its pages); a persistent grid of one program per SM
loops over them. Its query's index heads (64 for DeepSeek-V3.2; fewer are padded with zero
weights) are one 64-row wgmma tile. A step is `pages_per_step` whole pages (64 keys at
least), each page one TMA of the [block_size, Di] box `cache[block, :, replica 0, :]`,
`num_stages` steps in flight. Per step: S = Q K^T (wgmma, float32), relu, times each head's
weight (a row vector), summed over the heads (a reduction along the tile's rows, through
Mosaic's reduction scratch), written to the output's slice of those keys by TMA. Pages past
the query's position are not read, and their output is not written: the caller masks every
key past the query's position (`index_logits` returns them as -inf).

The queries of one prefill tile read the same pages, each its own copies (mostly from L2:
their items run side by side); keys shared across a tile's queries would need the queries
to come from one sequence. Interpret mode (Mosaic GPU's interpreter on CPU) runs this
kernel, with K^T through a scratch buffer (its wgmma takes no transposed operand) and plain
jnp where it has no layout casts.
"""

from __future__ import annotations

import functools
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

ROWS = 64  # index heads of a tile: one warpgroup's wgmma M


def _kernel(
    pages_ref,
    tables_ref,
    q_ref,
    w_ref,
    cache_ref,
    out_ref,
    q_smem,
    w_smem,
    k_smem,
    o_smem,
    kt_smem,
    q_bar,
    k_bars,
    *,
    max_blocks: int,
    pages_per_step: int,
    num_stages: int,
    num_splits: int,
    num_programs: int,
    num_work: int,
    interpret: bool,
):
    """GMEM refs: pages_ref i32[Q] (pages each query sees), tables_ref i32[Q * max_blocks],
    q_ref [Q, 64, Di], w_ref f32[Q, 64], cache_ref [N, bs, R, Di]; out_ref f32[Q, steps *
    keys] (whole steps: a table of pages not a multiple of a step's)."""
    ops = _Ops(interpret)
    num_blocks, block_size = cache_ref.shape[:2]
    keys = pages_per_step * block_size
    pid = lax.axis_index("program")

    def work_item(i, carry):
        w = pid + i * num_programs
        split, query = w % num_splits, w // num_splits
        plgpu.copy_gmem_to_smem(q_ref.at[query], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(w_ref.at[query], w_smem, q_bar)
        total = pl.cdiv(pages_ref[query], pages_per_step)
        per_split = pl.cdiv(total, num_splits)
        first_step = split * per_split
        num_steps = jnp.clip(total - first_step, 0, per_split)

        def issue(step, slot):
            for p in range(pages_per_step):
                column = jnp.minimum((first_step + step) * pages_per_step + p, max_blocks - 1)
                block = jnp.clip(tables_ref[query * max_blocks + column], 0, num_blocks - 1)
                rows = pl.ds(p * block_size, block_size)
                plgpu.copy_gmem_to_smem(
                    cache_ref.at[block, :, 0], k_smem.at[slot, rows], k_bars.at[slot]
                )

        for s in range(num_stages):
            pl.when(s < num_steps)(functools.partial(issue, s, s))
        plgpu.barrier_wait(q_bar)
        weights = ops.load_rows(w_smem)  # f32[64]: each head's weight, 0 for padding

        def step(j, carry):
            slot = lax.rem(j, num_stages)
            plgpu.barrier_wait(k_bars.at[slot])
            s = jnp.maximum(ops.scores(q_smem, k_smem.at[slot], kt_smem), 0.0)
            logits = (s * lax.broadcast_in_dim(weights, s.shape, [0])).sum(axis=0)  # [keys]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's row is out
            o_smem[...] = logits
            # The fence orders this step's reads of the slot (and the row's write) before the
            # TMA that refills it: the async proxy's writes are not ordered by program order.
            plgpu.commit_smem()

            @pl.when(j + num_stages < num_steps)  # the slot is free: refill it
            def _():
                issue(j + num_stages, slot)

            first_key = (first_step + j) * keys
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[query, pl.ds(first_key, keys)])
            return carry

        lax.fori_loop(0, num_steps, step, None)
        return carry

    lax.fori_loop(0, pl.cdiv(num_work - pid, num_programs), work_item, None)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit,
    static_argnames=("kv_tokens_per_step", "num_stages", "num_splits", "num_sms", "interpret"),
)
def index_logits(
    iq: jax.Array,
    iw: jax.Array,
    cache: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    *,
    kv_tokens_per_step: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    num_sms: int | None = None,
    interpret: Any = False,
) -> jax.Array:
    """The indexer's scores of each query's visible keys (Mosaic GPU kernel, sm_90):
    `index_logits_reference`'s contract, with iq taken in the cache's dtype (bf16 / f16:
    the wgmma's) and at most 64 heads, Di a multiple of 64."""
    num_q, heads, dim = iq.shape
    max_blocks = tables.shape[1]
    block_size = cache.shape[1]
    if cache.dtype not in (jnp.bfloat16, jnp.float16) or heads > ROWS or dim % 64:
        raise NotImplementedError(
            f"the Mosaic GPU indexer kernel takes a bf16/f16 cache, at most {ROWS} heads and "
            f"a head of a multiple of 64 (got {cache.dtype}, {heads} heads of {dim}): use "
            "index_logits_reference"
        )
    pages_per_step = mosaic_tiling.pages_per_step(block_size, kv_tokens_per_step)
    keys = pages_per_step * block_size
    max_steps = pl.cdiv(max_blocks, pages_per_step)
    sms = _default_num_sms() if num_sms is None else num_sms
    splits = num_splits or mosaic_tiling.plan_kv_splits(
        num_tiles=num_q, num_kv_heads=1, max_steps=max_steps, num_sms=sms
    )
    itemsize = jnp.dtype(cache.dtype).itemsize
    # as many steps in flight as fit beside q, the scores and Mosaic's reduction scratch
    budget = mosaic_tiling.HOPPER_SMEM_BYTES - ROWS * dim * itemsize - 8 * 1024
    stages = num_stages or max(1, min(mosaic_tiling.MAX_STAGES, budget // (keys * dim * itemsize)))
    q = jnp.pad(iq, ((0, 0), (0, ROWS - heads), (0, 0))).astype(cache.dtype)
    w = jnp.pad(iw.astype(jnp.float32), ((0, 0), (0, ROWS - heads)))
    pages = jnp.minimum(positions.astype(jnp.int32) // block_size + 1, max_blocks)

    swizzled = functools.partial(swizzled_smem, dtype=cache.dtype)

    scratch = [
        swizzled((ROWS, dim)),  # q
        plgpu.SMEM((ROWS,), jnp.float32),  # w
        swizzled((stages, keys, dim)),  # the step's keys
        plgpu.SMEM((keys,), jnp.float32),  # the step's scores
        swizzled((dim, keys)) if interpret is not False else None,  # K^T (interpreter only)
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=stages),
    ]
    num_work = num_q * splits
    programs = mosaic_tiling.num_programs(num_work=num_work, num_sms=sms)
    kernel = functools.partial(
        _kernel,
        max_blocks=max_blocks,
        pages_per_step=pages_per_step,
        num_stages=stages,
        num_splits=splits,
        num_programs=programs,
        num_work=num_work,
        interpret=interpret is not False,
    )
    out = persistent_kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_q, max_steps * keys), jnp.float32),  # whole steps
        num_programs=programs,
        scratch=scratch,
        interpret=interpret,
        name="dsa_index_logits_mosaic",
        reduction_scratch_bytes=4096,
    )(pages, tables.astype(jnp.int32).reshape(-1), q, w, cache)
    ctx = max_blocks * block_size
    visible = jnp.arange(ctx)[None] <= positions[:, None]
    return jnp.where(visible, out[:, :ctx], -jnp.inf)
