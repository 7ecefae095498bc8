"""The Pallas paged-attention kernel's tiling arithmetic: KV tokens per inner step, Triton
pipeline stages, the shared-memory estimate they must fit, how many programs a context's keys
are split across (all on the host, at trace time), and which sequences and query tiles each
kernel takes (a small XLA prologue).

`kernel.py` holds the kernels and their `pallas_call`s and asks this module how to tile a
call (`plan_attention`, `decode_seqs`, `assign_tiles`). Nothing here imports Pallas, Triton
or Mosaic (only jax core), so the planning is tested without them
(`tests/pallas_kernels/test_tiling.py`).

Shared memory: Triton keeps `num_stages` buffers of each inner step's K and V tiles (its
software pipeline) and the query tile in shared memory, which is 227 KB per block on Hopper.
`plan_tiles` shrinks the KV tokens per step, then the stages, until that estimate fits, and
refuses (naming dtype, head_dim and bytes) shapes nothing fits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

MIN_DOT = 16  # tl.dot needs every dimension >= 16
# Shared memory a block may use on Hopper (H100, H200): 227 KB, what Triton reports as
# "available" there. (Ampere A100: 166912; other Ampere / Ada parts: 101376.)
HOPPER_SMEM_BYTES = 232448
_DEFAULT_KV_TOKENS = {"decode": 128, "mixed": 64}  # per inner step, before fitting
_DEFAULT_STAGES = 2
HOPPER_NUM_SMS = 132  # H100 SXM and H200; the default where no GPU is attached
_PROGRAMS_PER_SM = 2  # programs the KV splits aim for, per SM
_MAX_KV_SPLITS = 64


def smem_bytes(
    *,
    rows: int,
    head_dim: int,
    kv_tokens: int,
    num_stages: int,
    itemsize: int,
    kv_width: int | None = None,
) -> int:
    """Estimated shared memory of one program of either kernel: `num_stages` buffers of an
    inner step's K and V tiles ([kv_tokens, D] each; a single buffer without pipelining) and
    the query tile [rows, D], all at `itemsize` bytes. Matches what Triton asked for on the
    H100 (jax 0.11.2) for the fp32, head_dim 128 decode kernel with 16 rows, 128 tokens and 2
    stages: 2 * 2 * 128 * 128 * 4 + 16 * 128 * 4 = 270336. kv_width: values a key and its
    value take per token (default 2 * D; MLA's D, the latent being both)."""
    kv_width = 2 * head_dim if kv_width is None else kv_width
    return (max(1, num_stages) * kv_tokens * kv_width + rows * head_dim) * itemsize


class TilePlan(NamedTuple):
    """One kernel's tiling: KV pages per inner step, Triton pipeline stages, and its
    estimated shared memory (smem_bytes)."""

    pages_per_step: int
    num_stages: int
    smem_bytes: int


def plan_tiles(
    kernel: str,
    *,
    dtype,
    head_dim: int,
    block_size: int,
    rows: int,
    kv_tokens: int | None = None,
    num_stages: int | None = None,
    smem_limit: int = HOPPER_SMEM_BYTES,
    kv_width: int | None = None,
) -> TilePlan:
    """The tiling of `kernel` ("decode": rows = the GQA group padded to 16; "mixed": rows =
    q_block) for queries of `dtype` (K/V tiles are held at its width: an fp8 cache is widened
    to it) and head_dim, within smem_limit bytes of shared memory.

    kv_tokens (whole pages, at least one) and num_stages given are kept and checked; left None
    they start at the defaults (decode 128 tokens, mixed 64; 2 stages) and the tokens per
    step are halved down to max(block_size, 16), then the stages lowered to 1, until the
    estimate fits. Raises ValueError when it does not."""
    itemsize = jnp.dtype(dtype).itemsize
    name = jnp.dtype(dtype).name
    smallest = max(block_size, MIN_DOT)
    tokens = _DEFAULT_KV_TOKENS[kernel] if kv_tokens is None else kv_tokens
    tokens = max(block_size, tokens // block_size * block_size)
    stages = _DEFAULT_STAGES if num_stages is None else num_stages

    def need(tokens, stages):
        return smem_bytes(
            rows=rows,
            head_dim=head_dim,
            kv_tokens=tokens,
            num_stages=stages,
            itemsize=itemsize,
            kv_width=kv_width,
        )

    while need(tokens, stages) > smem_limit:
        if kv_tokens is None and tokens > smallest:
            tokens = max(smallest, tokens // 2 // block_size * block_size)
        elif num_stages is None and stages > 1:
            stages -= 1
        else:
            raise ValueError(
                f"ragged_paged_attention: the {kernel} kernel does not fit in shared memory for "
                f"dtype {name}, head_dim {head_dim} (block_size {block_size}, {rows} query "
                f"rows): {tokens} KV tokens per step in {stages} pipeline stage(s) need about "
                f"{need(tokens, stages)} B, {smem_limit} B are available"
            )
    return TilePlan(tokens // block_size, stages, need(tokens, stages))


def plan_kv_splits(*, num_seqs: int, num_kv_heads: int, max_steps: int, num_sms: int) -> int:
    """How many programs a kernel splits each sequence's (decode) or query tile's (mixed;
    num_seqs = tiles) keys across, their partial softmaxes merged after: enough that the
    num_seqs x num_kv_heads x splits programs give every one of num_sms SMs _PROGRAMS_PER_SM,
    so a small batch still streams from every SM; one where the batch alone fills them (no
    partials, no merge). Never more than max_steps, the inner steps the block table holds (a
    split past the longest possible context is always empty), nor _MAX_KV_SPLITS. A context
    shorter than splits x a step leaves the trailing splits empty (each split takes at least
    one step)."""
    want = -(-_PROGRAMS_PER_SM * num_sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_steps, _MAX_KV_SPLITS))


def default_num_sms() -> int:
    """SMs of the default device when it is a GPU (its core_count), else Hopper's 132."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return int(getattr(device, "core_count", 0) or HOPPER_NUM_SMS)
    return HOPPER_NUM_SMS


def decode_rows(group: int) -> int:
    """Rows of the decode kernel's query tile: the GQA group padded to a power of two of at
    least MIN_DOT (Triton tensors have power-of-two sizes)."""
    return max(MIN_DOT, 1 << max(0, group - 1).bit_length())


def check_shapes(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    q_block: int,
    latent: int | None = None,
) -> None:
    """Raise ValueError, naming the value, for shapes the Triton lowering cannot tile:
    Hq not a multiple of Hkv, head_dim / block_size / q_block not powers of two, q_block
    under MIN_DOT. MLA (latent: its kv_lora_rank): the latent and the rotary width
    head_dim - latent powers of two instead of head_dim, the latent a multiple of the other,
    the rotary width at least MIN_DOT."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    dims = [("head_dim", head_dim)]
    if latent is not None:
        rope = head_dim - latent
        dims = [("kv_lora_rank", latent), ("qk_rope_head_dim", rope)]
        if rope < MIN_DOT or latent % rope:
            raise ValueError(
                f"kv_lora_rank={latent} must be a multiple of qk_rope_head_dim={rope}, itself "
                f"at least {MIN_DOT}, for the Pallas MLA kernel"
            )
    for name, value in (*dims, ("block_size", block_size), ("q_block", q_block)):
        if value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two for the Pallas kernel")
    if q_block < MIN_DOT:
        raise ValueError(f"q_block={q_block} must be at least {MIN_DOT}")


class AttentionPlan(NamedTuple):
    """Both kernels' tilings for one call: the decode kernel's, the mixed kernel's (None in a
    decode-only call) and the KV splits of each (mixed_kv_splits None where mixed is)."""

    decode: TilePlan
    mixed: TilePlan | None
    num_kv_splits: int
    mixed_kv_splits: int | None


def plan_attention(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    block_tables_shape: tuple[int, ...],
    *,
    dtype,
    decode_only: bool,
    q_block: int,
    decode_pages_per_step: int | None = None,
    prefill_kv_tokens_per_step: int | None = None,
    num_kv_splits: int | None = None,
    mixed_kv_splits: int | None = None,
    num_stages: int | None = None,
    smem_limit: int = HOPPER_SMEM_BYTES,
    num_sms: int | None = None,
    latent: int | None = None,
) -> AttentionPlan:
    """The tiling `ragged_paged_attention` runs for q [T, Hq, D], a cache [num_blocks,
    block_size, Hkv, D] and block tables [S, max_blocks] with its tuning arguments (read its
    docstring for them; None: not given). Checks the shapes (`check_shapes`), then plans each
    kernel's tiles (`plan_tiles`) for K/V tiles of `dtype` (the wider of q's and the cache's)
    and, where not given, the KV splits (`plan_kv_splits`): the decode kernel's over S
    sequences, the mixed kernel's over the fewest q_block-row tiles T tokens can make, both
    for num_sms SMs (None: `default_num_sms()`). MLA (latent: kv_lora_rank): q_shape and
    cache_shape in query head blocks (`kernel.split_heads`: Hq = blocks x g, Hkv = blocks),
    D the latent plus the rotary key, and the latent both key and value."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, block_size, num_kv_heads, _ = cache_shape
    max_seqs, max_blocks = block_tables_shape
    check_shapes(
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        q_block=q_block,
        latent=latent,
    )
    group = num_q_heads // num_kv_heads
    plan = functools.partial(
        plan_tiles,
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        num_stages=num_stages,
        smem_limit=smem_limit,
        kv_width=None if latent is None else head_dim,
    )
    decode_requested = None if decode_pages_per_step is None else decode_pages_per_step * block_size
    decode_plan = plan("decode", rows=decode_rows(group), kv_tokens=decode_requested)
    mixed_plan = None
    if not decode_only:
        mixed_plan = plan("mixed", rows=q_block, kv_tokens=prefill_kv_tokens_per_step)
    num_sms = default_num_sms() if num_sms is None else num_sms
    if num_kv_splits is None:
        num_kv_splits = plan_kv_splits(
            num_seqs=max_seqs,
            num_kv_heads=num_kv_heads,
            max_steps=-(-max_blocks // decode_plan.pages_per_step),
            num_sms=num_sms,
        )
    if mixed_kv_splits is None and mixed_plan is not None:
        mixed_kv_splits = plan_kv_splits(  # the fewest tiles T tokens can make
            num_seqs=-(-num_tokens * group // q_block),
            num_kv_heads=num_kv_heads,
            max_steps=-(-max_blocks // mixed_plan.pages_per_step),
            num_sms=num_sms,
        )
    return AttentionPlan(decode_plan, mixed_plan, num_kv_splits, mixed_kv_splits)


def decode_seqs(query_start_loc: jax.Array, num_seqs: jax.Array, *, decode_only: bool) -> jax.Array:
    """bool[S]: the sequences the decode kernel takes, from query_start_loc i32[S+1] and
    num_seqs i32[1]: the real ones of one query token, or every real one where the caller
    promises decode_only. The mixed kernel takes the real ones of more (`assign_tiles`)."""
    real = jnp.arange(query_start_loc.shape[0] - 1) < num_seqs[0]
    if decode_only:
        return real  # the caller's promise
    return real & (query_start_loc[1:] - query_start_loc[:-1] == 1)


def assign_tiles(
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    group: int,
    q_block: int,
) -> tuple[jax.Array, jax.Array]:
    """The mixed kernel's query tiles, in XLA: sequence s of q_len > 1 tokens gets
    ceil(q_len * group / q_block) tiles, in order; single-token sequences get none (the
    decode kernel takes them).

    Args:
      query_start_loc: i32[S+1] row offsets of each sequence's queries.
      num_seqs: i32[1] number of real sequences.

    Returns:
      tile_seq i32[max_tiles]: each tile's sequence, -1 for tiles past the last; tile_row
      i32[max_tiles]: the tile's first row (token x group + head) within its sequence.
      max_tiles = ceil(num_tokens * group / q_block) + min(S, num_tokens), a static bound.
    """
    max_seqs = query_start_loc.shape[0] - 1
    real = jnp.arange(max_seqs) < num_seqs[0]
    q_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)
    q_lens = jnp.where(q_lens > 1, q_lens, 0)
    tiles = (q_lens * group + q_block - 1) // q_block
    ends = jnp.cumsum(tiles)
    max_tiles = -(-num_tokens * group // q_block) + min(max_seqs, num_tokens)
    tile_ids = jnp.arange(max_tiles, dtype=jnp.int32)
    tile_seq = jnp.searchsorted(ends, tile_ids, side="right").astype(jnp.int32)
    tile_seq_c = jnp.minimum(tile_seq, max_seqs - 1)
    tile_row = (tile_ids - (ends[tile_seq_c] - tiles[tile_seq_c])) * q_block
    return jnp.where(tile_ids < ends[-1], tile_seq, -1), tile_row


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array, sink=None) -> jax.Array:
    """Partial softmaxes of the same rows over disjoint key ranges -> their attention:
    o f32[K, ..., D] unnormalised outputs, m and l f32[K, ...] their maxima (log2 units)
    and sums -> f32[..., D]; sink (f32, broadcast to [...], log2 units) joins the
    denominator. The K splits (a static count) are unrolled into elementwise terms, so the
    merge, with the gathers that feed it, is one loop fusion (reductions over the split axis
    were a kernel each: three or four launches a layer for a split decode)."""
    splits = range(m.shape[0])
    m_all = functools.reduce(jnp.maximum, [m[k] for k in splits])
    if sink is not None:
        m_all = jnp.maximum(m_all, sink)
    w = [jnp.exp2(m[k] - m_all) for k in splits]
    denom = functools.reduce(jnp.add, [w[k] * l[k] for k in splits])
    if sink is not None:
        denom = denom + jnp.exp2(sink - m_all)
    num = functools.reduce(jnp.add, [w[k][..., None] * o[k] for k in splits])
    return num / jnp.maximum(denom, 1e-30)[..., None]
