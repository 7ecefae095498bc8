"""The grouped matmul as a Mosaic GPU kernel (Pallas, Hopper: TMA + wgmma) that reads packed
expert weights and decodes them inside the kernel: `grouped_matmul`'s contract
(x [M, K] bf16 rows sorted by group, w [G, K, N] bf16 or `packed.Packed`, group_sizes
i32[G] -> [M, N], rows past the groups zero), with `reference` (ragged_dot on the decoded
weights) as its oracle.

Work. The rows are cut into 64-row *blocks* (one warpgroup's wgmma M); a *tile* is the part
of one group's rows inside one block (a group straddling a block boundary has two tiles). An
XLA prologue lists the tiles (group, block, first row in the block, row count); groups with
no rows have none, so their experts are never read. A work item is (tile, column block of
`block_n`); a persistent grid of `num_programs` programs takes items pid, pid + grid, ...
Each item streams its group's weights down K (`emit_pipeline`: TMA copies of the next
`max_concurrent_steps` steps in flight), so each routed expert's column block is read once
per tile whatever its row count.

Decoding. Packed weights (packed.py's layout) are decoded in registers one scale group at a
time, written to shared memory in bf16 and multiplied there (wgmma reads its B operand from
shared memory). The group's scale (and offset) is applied to the [64, block_n] product, not
to the weights: acc += (x_g @ q_g) * s_g (+ sum(x_g) * o_g), which needs only column vectors
in registers. 4-bit formats hold inputs 2r and 2r + 1 in the low and high nibble of packed
row r: x is split into its even and odd columns in the prologue and each plane is one wgmma
against the decoded nibbles of that plane. fp8 (e4m3) goes through f16 and f32 to bf16
(Hopper converts e4m3 to f16 only). MXFP4's e8m0 scale becomes 2 ** (e - 127) by shifting it
into a float32's exponent bits.

Interpret mode (`interpret=True`, Mosaic GPU's interpreter on CPU) runs this same kernel; the
tests compare it with `reference` for every format.
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

from pallas_kernels.grouped_matmul.packed import Packed
from pallas_kernels.paged_attention.mosaic import _default_num_sms, persistent_kernel

ROWS = 64  # rows of a block: the wgmma M of one warpgroup
SWIZZLE = 128  # bytes


def _transforms(dtype, minor: int = SWIZZLE) -> tuple:
    """Shared-memory tiling and swizzle for a wgmma operand of `dtype` (16-bit) whose slices
    along the minor dimension are `minor` elements (the swizzle: at most 128 bytes)."""
    swizzle = min(SWIZZLE, minor * jnp.dtype(dtype).itemsize)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def tile_table(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, int]:
    """The tiles of `group_sizes` over `num_rows` rows: i32[max_tiles, 4] of (group or -1,
    block, first row within the block, rows), and max_tiles (a static bound: blocks plus one
    per group boundary)."""
    g = group_sizes.shape[0]
    max_tiles = -(-num_rows // ROWS) + min(g, max(num_rows, 1)) - 1
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // ROWS
    count = jnp.where(group_sizes > 0, (ends - 1) // ROWS - first + 1, 0)
    tile_end = jnp.cumsum(count)
    ids = jnp.arange(max_tiles, dtype=jnp.int32)
    # compare_all: a [max_tiles, G] comparison in one fusion (the default binary search is a
    # while loop, kernels of its own each iteration)
    group = jnp.searchsorted(tile_end, ids, side="right", method="compare_all")
    group = jnp.minimum(group, g - 1).astype(jnp.int32)
    block = first[group] + ids - (tile_end[group] - count[group])
    lo = jnp.maximum(starts[group], block * ROWS)
    hi = jnp.minimum(ends[group], (block + 1) * ROWS)
    valid = ids < tile_end[-1]
    table = jnp.stack(
        [jnp.where(valid, group, -1), block, lo - block * ROWS, jnp.where(valid, hi - lo, 0)], 1
    )
    return table.astype(jnp.int32), max_tiles


def _decode(q: jax.Array, plane: int, mode: str) -> jax.Array:
    """Codes [r, n] (uint8 nibble pairs, e4m3, int8) -> float32 values, unscaled."""
    if mode in ("int4", "mxfp4"):
        c = q.astype(jnp.int32)  # Mosaic GPU: no 8-bit arithmetic
        c = (c >> 4) if plane else (c & 0xF)
        if mode == "int4":
            return c.astype(jnp.float32)
        # OCP e2m1: sign bit 3, exponent bits 1-2, mantissa bit 0
        e, m = (c >> 1) & 3, (c & 1).astype(jnp.float32)
        mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << jnp.maximum(e - 1, 0)))
        return jnp.where(c >= 8, -mag, mag)
    if mode == "fp8_block":
        return q.astype(jnp.float16).astype(jnp.float32)
    return q.astype(jnp.int32).astype(jnp.float32)  # gguf int8


class _Ops:
    """What differs between compiled and interpreted kernels."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def rows_iota(self, shape):  # i32 row index in the wgmma accumulator's layout
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, 0)
        return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)


def _mode(w: jax.Array | Packed) -> str:
    if not isinstance(w, Packed):
        return "dense"
    if w.kernel.dtype == jnp.uint8:
        return "mxfp4" if w.scale.dtype == jnp.uint8 else "int4"
    return "fp8_block" if w.kernel.dtype == jnp.float8_e4m3fn else "gguf"


def _kernel(
    table_ref,
    *refs,
    mode,
    planes,
    group_rows,
    groups_per_step,
    steps,
    block_n,
    num_n,
    num_items,
    num_programs,
    max_concurrent_steps,
    offsets,
    interpret,
):
    """One program of the persistent grid. refs: the x planes [M_pad, Kp] (bf16), the codes
    [G, Kp, N] (or bf16 weights), then for packed modes the scales [G, Kp / gp, N], offsets
    and x sums [K / g, M_pad] (when `offsets`); the output [M_pad, N]; scratch."""
    refs = list(refs)
    xs = refs[:planes]
    w_ref = refs[planes]
    rest = refs[planes + 1 :]
    s_ref = None if mode == "dense" else rest.pop(0)
    o_ref = rest.pop(0) if offsets else None
    out_ref, out_smem, *dec_smem = rest
    pid = lax.axis_index("program")
    ops = _Ops(interpret)
    p_rows = group_rows * groups_per_step  # packed rows a step

    def item(i, carry):
        it = pid + i * num_programs
        tile = jnp.minimum(it // num_n, table_ref.shape[0] // 4 - 1)
        group = table_ref[4 * tile]
        rows = table_ref[4 * tile + 3]

        @pl.when((it < num_items) & (group >= 0) & (rows > 0))
        def _():
            _tile(group, table_ref[4 * tile + 1], table_ref[4 * tile + 2], rows, it % num_n)

        return carry

    def _tile(group, block, first, rows, nb):
        x_specs = [
            plgpu.BlockSpec((ROWS, p_rows), lambda k: (block, k), transforms=_transforms(x.dtype))
            for x in xs
        ]
        gmem = list(xs)
        if mode == "dense":
            specs = [
                *x_specs,
                plgpu.BlockSpec(
                    (p_rows, block_n), lambda k: (k, nb), transforms=_transforms(w_ref.dtype)
                ),
            ]
            gmem.append(w_ref.at[group])
        else:
            specs = [*x_specs, plgpu.BlockSpec((p_rows, block_n), lambda k: (k, nb))]
            specs.append(plgpu.BlockSpec((groups_per_step, block_n), lambda k: (k, nb)))
            gmem += [w_ref.at[group], s_ref.at[group]]
            if offsets:
                specs.append(plgpu.BlockSpec((groups_per_step, block_n), lambda k: (k, nb)))
                gmem.append(o_ref.at[group])

        def body(acc_ref, *smem):
            x_smem = smem[:planes]
            if mode == "dense":
                plgpu.wgmma(acc_ref, x_smem[0], smem[planes])
                return
            q_smem, sc_smem, *off = smem[planes:]
            for c in range(p_rows // ROWS):  # decode the step's codes, 64 rows at a time
                q = q_smem[pl.ds(c * ROWS, ROWS), :]
                scale = _expand(sc_smem, c, _scale_row)
                offset = _expand(off[0], c, lambda o: o) if offsets else None
                for p in range(planes):
                    v = _decode(q, p, mode) * scale
                    v = v if offset is None else v + offset
                    dec_smem[p][pl.ds(c * ROWS, ROWS), :] = v.astype(jnp.bfloat16)
            plgpu.commit_smem()
            for p in range(planes):
                plgpu.wgmma(acc_ref, x_smem[p], dec_smem[p])
            plgpu.wgmma_wait(0)  # the decoded buffers are rewritten by the next step

        def _expand(ref, c, f):
            """[64, block_n] f32 of chunk c's rows: each row its scale group's row of ref."""
            if group_rows >= ROWS:
                return jnp.broadcast_to(f(ref[c * ROWS // group_rows])[None, :], (ROWS, block_n))
            row = ops.rows_iota((ROWS, block_n)) // group_rows
            first = c * ROWS // group_rows
            out = jnp.broadcast_to(f(ref[first])[None, :], (ROWS, block_n))
            for j in range(1, ROWS // group_rows):
                out = jnp.where(row == j, f(ref[first + j])[None, :], out)
            return out

        def _scale_row(s):
            if mode == "mxfp4":  # e8m0 -> 2 ** (e - 127)
                return lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)
            return s.astype(jnp.float32)

        def run(acc_ref):
            plgpu.emit_pipeline(
                lambda _, *smem: body(acc_ref, *smem),
                grid=(steps,),
                in_specs=specs,
                max_concurrent_steps=max_concurrent_steps,
            )(*gmem)
            return acc_ref[...]

        acc = pl.run_scoped(run, plgpu.ACC((ROWS, block_n), jnp.float32))
        _store(acc, block, first, rows, nb)

    def _store(acc, block, first, rows, nb):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        start, size = first, ROWS
        while size >= 1:  # rows first .. first + rows - 1 as power-of-two runs
            pl.when((rows & size) != 0)(functools.partial(_copy_rows, start, size, block, nb))
            start = start + (rows & size)
            size //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def _copy_rows(start, size, block, nb):
        plgpu.copy_smem_to_gmem(
            out_smem.at[pl.ds(start, size)],
            out_ref.at[pl.ds(block * ROWS + start, size), pl.ds(nb * block_n, block_n)],
        )

    lax.fori_loop(0, -(-num_items // num_programs), item, None)


def grouped_matmul_mosaic(
    x: jax.Array,
    w: jax.Array | Packed,
    group_sizes: jax.Array,
    *,
    block_n: int | None = None,
    max_concurrent_steps: int = 4,
    num_programs: int | None = None,
    interpret: Any = False,
) -> jax.Array:
    """x [M, K] bf16, w [G, K, N] bf16 or packed, group_sizes i32[G] -> [M, N] bf16 (the
    module doc). block_n: output columns an item computes (a multiple of 64 dividing N;
    default 128, or 64 where 128 leaves SMs idle at decode); a pipeline step streams 64
    packed rows of K, or one scale group where larger."""
    mode = _mode(w)
    m, k = x.shape
    _, k2, n = w.shape
    if k != k2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x {x.shape} {x.dtype} and w {w.shape}: K must agree, x bf16")
    table, max_tiles = tile_table(group_sizes.astype(jnp.int32), m)
    if block_n is None:  # decode (few tiles): narrower items so that every SM has one
        block_n = 128 if n % 128 == 0 and max_tiles * n // 128 >= _default_num_sms() else 64
    if n % block_n or block_n % 64:
        raise ValueError(f"N={n} must be a multiple of block_n={block_n}, itself of 64")
    planes, group_rows, p_rows, problem = _geometry(w)
    if problem:
        raise ValueError(problem)
    kp = k // planes
    steps = -(-kp // p_rows)
    if kp % p_rows and interpret:  # e.g. gpt-oss's K = 2880: 1440 packed rows, 22.5 steps
        raise ValueError(
            f"{mode}: K={k} ends inside a step of {p_rows} packed rows: on a GPU the last "
            "step's copies read zeros past K (TMA), the interpreter refuses such reads"
        )
    groups_per_step = p_rows // group_rows
    m_pad = -(-m // ROWS) * ROWS
    xp = jnp.pad(x, ((0, m_pad - m), (0, steps * p_rows * planes - k)))  # zeros past K
    xs = [xp[:, p::planes] for p in range(planes)] if planes == 2 else [xp]
    offsets = mode != "dense" and w.offset is not None
    args = [table.reshape(-1), *xs]
    if mode == "dense":
        args.append(w)
    else:
        args += [w.kernel, w.scale]
        if offsets:
            args.append(w.offset)
    num_n = n // block_n
    num_items = max_tiles * num_n
    num_programs = min(num_programs or _default_num_sms(), num_items)
    scratch = [plgpu.SMEM((ROWS, block_n), jnp.bfloat16)]
    if mode != "dense":
        scratch += [
            plgpu.SMEM((p_rows, block_n), jnp.bfloat16, transforms=_transforms(jnp.bfloat16))
            for _ in range(planes)
        ]
    kernel = functools.partial(
        _kernel,
        mode=mode,
        planes=planes,
        group_rows=group_rows,
        groups_per_step=groups_per_step,
        steps=steps,
        block_n=block_n,
        num_n=num_n,
        num_items=num_items,
        num_programs=num_programs,
        max_concurrent_steps=max(1, min(max_concurrent_steps, steps)),
        offsets=offsets,
        interpret=bool(interpret),
    )
    out = persistent_kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m_pad, n), jnp.bfloat16),
        num_programs=num_programs,
        scratch=scratch,
        interpret=interpret,
    )(*args)
    total = jnp.sum(group_sizes)
    return jnp.where(jnp.arange(m)[:, None] < total, out[:m], jnp.zeros((), out.dtype))


def _geometry(w: jax.Array | Packed) -> tuple[int, int, int, str | None]:
    """(planes, packed rows a scale group, packed rows a pipeline step, why the kernel cannot
    take w or None). A step is 64 packed rows (decoded at once, in the wgmma layout) or one
    larger group; groups must be whole 16s (wgmma's K) and cover K."""
    mode = _mode(w)
    planes = 2 if mode in ("int4", "mxfp4") else 1
    group_rows = (w.group // planes) if mode != "dense" else ROWS
    p_rows = max(ROWS, group_rows)
    kp = w.shape[1] // planes
    problem = None
    if group_rows % 16 or p_rows % group_rows or kp % group_rows:
        problem = f"{mode}: K={w.shape[1]} is not in whole groups of {group_rows} packed rows"
    return planes, group_rows, p_rows, problem


def fits(x: jax.Array, w: jax.Array | Packed, block_n: int = 64) -> bool:
    """Whether `grouped_matmul_mosaic` takes these operands."""
    return (
        x.dtype == jnp.bfloat16
        and w.shape[2] % block_n == 0
        and _geometry(w)[3] is None
        and math.prod(w.shape) > 0
    )
