"""The Mosaic GPU paged-attention kernel's tiling arithmetic, in plain Python (no jax).

`mosaic.py` asks this module how to tile a call: query rows per tile (one wgmma's M), KV
tokens per pipeline step (whole pages), how many steps the TMA pipeline keeps in flight
within Hopper's shared memory, how many programs split a tile's keys, and the size of the
persistent grid. Everything here is host arithmetic on static shapes, tested without jax
(`tests/pallas_kernels/test_mosaic_kernel.py`).

Shared memory of one program (`smem_bytes`): `stages` buffers of a step's K and V tiles
([kv_tokens, D] each), the query tile [TILE_ROWS, D], the probabilities [TILE_ROWS,
kv_tokens] (the second wgmma reads them from shared memory), the output tile [TILE_ROWS, D]
(float32 partials when the keys are split, else q's dtype), the rows' positions, sinks and
softmax statistics ([TILE_ROWS] each, 4 bytes) and the barriers (8 bytes each, two per
stage and one for the query tile).
"""

from __future__ import annotations

from typing import NamedTuple

# Shared memory one block may use on Hopper (H100, H200): 227 KiB of the SM's 228 KiB.
HOPPER_SMEM_BYTES = 232448
HOPPER_NUM_SMS = 132  # H100 SXM and H200
TILE_ROWS = 64  # query rows per program: the M of one warpgroup's wgmma
KV_TOKEN_QUANTUM = 64  # a step's keys: a multiple of the PV wgmma's K tile (128 B swizzle)
MAX_KV_TOKENS = 256  # the QK wgmma's N is at most 256
DEFAULT_KV_TOKENS = 64  # keys per step before fitting (whole pages, at least one)
MAX_STAGES = 4  # TMA steps in flight at most
PROGRAMS_PER_SM = 2  # the KV splits aim for this many work items per SM
MAX_KV_SPLITS = 64
_BARRIER_BYTES = 8


class MosaicPlan(NamedTuple):
    """One call's tiling: KV pages per pipeline step, the steps in flight (stages), programs
    per tile's keys (num_kv_splits), the persistent grid's programs and the estimated
    shared memory of one program."""

    pages_per_step: int
    num_stages: int
    num_kv_splits: int
    num_programs: int
    smem_bytes: int


def tiles_per_sequence(q_len: int, group: int) -> int:
    """Query tiles of a sequence of q_len tokens: its q_len x group rows (token, head of
    the GQA group), TILE_ROWS a tile; a decode (q_len 1) of any group up to TILE_ROWS
    is one tile, its group padded to TILE_ROWS rows."""
    return -(-q_len * group // TILE_ROWS)


def max_tiles(*, num_tokens: int, group: int, max_seqs: int, decode_only: bool) -> int:
    """A static bound on the tiles of any batch of num_tokens query tokens over max_seqs
    sequences: each sequence's last tile may be partial, so ceil(T x group / TILE_ROWS)
    plus one per sequence that can hold tokens; decode-only, exactly one tile group per
    sequence (ceil(group / TILE_ROWS) tiles each)."""
    if decode_only:
        return max_seqs * tiles_per_sequence(1, group)
    return -(-num_tokens * group // TILE_ROWS) + min(max_seqs, num_tokens)


def pages_per_step(block_size: int, kv_tokens: int | None = None) -> int:
    """KV pages per pipeline step: kv_tokens (default DEFAULT_KV_TOKENS) in whole pages, the
    step's tokens a multiple of KV_TOKEN_QUANTUM and at most MAX_KV_TOKENS (a page larger
    than that cannot be tiled). Raises ValueError for a size that does not tile."""
    tokens = DEFAULT_KV_TOKENS if kv_tokens is None else kv_tokens
    tokens = max(tokens, block_size, KV_TOKEN_QUANTUM)
    pages = -(-tokens // block_size)
    step = pages * block_size
    if step % KV_TOKEN_QUANTUM or step > MAX_KV_TOKENS:
        raise ValueError(
            f"mosaic ragged_paged_attention: {pages} page(s) of block_size {block_size} make "
            f"{step} keys per step; it must be a multiple of {KV_TOKEN_QUANTUM} and at most "
            f"{MAX_KV_TOKENS} (block_size a power of two from 8 to 256)"
        )
    return pages


def smem_bytes(
    *, head_dim: int, kv_tokens: int, num_stages: int, itemsize: int, split: bool
) -> int:
    """Estimated shared memory of one program (see the module docstring)."""
    kv = num_stages * 2 * kv_tokens * head_dim * itemsize
    q = TILE_ROWS * head_dim * itemsize
    p = TILE_ROWS * kv_tokens * itemsize
    out = TILE_ROWS * head_dim * (4 if split else itemsize)
    rows = 4 * TILE_ROWS * 4  # positions, sinks, max, sum
    barriers = (2 * num_stages + 1) * _BARRIER_BYTES
    return kv + q + p + out + rows + barriers


def plan_stages(
    *,
    head_dim: int,
    kv_tokens: int,
    itemsize: int,
    split: bool,
    num_stages: int | None = None,
    smem_limit: int = HOPPER_SMEM_BYTES,
) -> int:
    """The most pipeline stages (at most MAX_STAGES) whose buffers fit smem_limit; a
    num_stages given is kept and checked. Raises ValueError naming the bytes when even
    one stage does not fit."""
    stages = MAX_STAGES if num_stages is None else num_stages
    if stages < 1:
        raise ValueError(f"num_stages={stages} must be at least 1")

    def need(s):
        return smem_bytes(
            head_dim=head_dim, kv_tokens=kv_tokens, num_stages=s, itemsize=itemsize, split=split
        )

    while need(stages) > smem_limit and num_stages is None and stages > 1:
        stages -= 1
    if need(stages) > smem_limit:
        raise ValueError(
            f"mosaic ragged_paged_attention does not fit in shared memory: head_dim "
            f"{head_dim}, {kv_tokens} keys per step in {stages} stage(s) at {itemsize} B need "
            f"about {need(stages)} B, {smem_limit} B are available"
        )
    return stages


def plan_kv_splits(*, num_tiles: int, num_kv_heads: int, max_steps: int, num_sms: int) -> int:
    """Programs each (tile, KV head)'s keys are split across, merged after in XLA: enough
    that tiles x heads x splits give every SM PROGRAMS_PER_SM work items, 1 when the tiles
    alone do; never more than max_steps (the steps a whole block table holds) nor
    MAX_KV_SPLITS."""
    want = -(-PROGRAMS_PER_SM * num_sms // max(1, num_tiles * num_kv_heads))
    return max(1, min(want, max_steps, MAX_KV_SPLITS))


def num_programs(*, num_work: int, num_sms: int) -> int:
    """The persistent grid: one program per SM (or fewer when there is less work), each
    looping over the work items pid, pid + grid, ..."""
    return max(1, min(num_work, num_sms))


def plan(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_seqs: int,
    max_blocks: int,
    itemsize: int,
    decode_only: bool,
    kv_tokens: int | None = None,
    num_stages: int | None = None,
    num_kv_splits: int | None = None,
    num_sms: int = HOPPER_NUM_SMS,
    smem_limit: int = HOPPER_SMEM_BYTES,
) -> MosaicPlan:
    """The whole tiling of one call. Raises ValueError for shapes the kernel cannot take:
    Hq not a multiple of Hkv, head_dim not a multiple of 64, block_size not a power of two
    from 8 to 256, or a tiling over smem_limit."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if head_dim % 64:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 64 for the Mosaic kernel")
    if block_size & (block_size - 1) or not 8 <= block_size <= MAX_KV_TOKENS:
        raise ValueError(
            f"block_size={block_size} must be a power of two from 8 to {MAX_KV_TOKENS} for the "
            "Mosaic kernel"
        )
    group = num_q_heads // num_kv_heads
    pages = pages_per_step(block_size, kv_tokens)
    tiles = max_tiles(
        num_tokens=num_tokens, group=group, max_seqs=max_seqs, decode_only=decode_only
    )
    if num_kv_splits is None:
        # the fewest tiles the batch can make: T tokens' rows, or one tile group a decode
        fewest = tiles if decode_only else -(-num_tokens * group // TILE_ROWS)
        num_kv_splits = plan_kv_splits(
            num_tiles=fewest,
            num_kv_heads=num_kv_heads,
            max_steps=-(-max_blocks // pages),
            num_sms=num_sms,
        )
    split = num_kv_splits > 1
    stages = plan_stages(
        head_dim=head_dim,
        kv_tokens=pages * block_size,
        itemsize=itemsize,
        split=split,
        num_stages=num_stages,
        smem_limit=smem_limit,
    )
    work = tiles * num_kv_heads * num_kv_splits
    need = smem_bytes(
        head_dim=head_dim,
        kv_tokens=pages * block_size,
        num_stages=stages,
        itemsize=itemsize,
        split=split,
    )
    return MosaicPlan(
        pages, stages, num_kv_splits, num_programs(num_work=work, num_sms=num_sms), need
    )
