"""The paged-attention kernel's tiling arithmetic, without running a kernel: the shared-memory
estimate and the tilings fitted to it, the KV splits, a whole call's plan and the batch's
division between the two kernels; and that tiling.py imports no Pallas, Triton or Mosaic."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.tiling import (
    HOPPER_SMEM_BYTES,
    TilePlan,
    assign_tiles,
    decode_seqs,
    plan_attention,
    plan_kv_splits,
    plan_tiles,
    smem_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


def test_importing_tiling_loads_no_pallas_triton_or_mosaic():
    """tiling.py, executed in a fresh interpreter, adds no module named for Pallas, Triton or
    Mosaic to what `import jax` itself loads (jaxlib registers its own triton and mosaic
    extension modules there). The file is loaded by path: the package's __init__ imports the
    kernel, which is not what this checks."""
    script = textwrap.dedent(
        """
        import importlib.util, sys
        import jax, jax.numpy
        before = set(sys.modules)
        name = "pallas_kernels.paged_attention.tiling"
        spec = importlib.util.spec_from_file_location(name, sys.argv[1])
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        new = sorted(set(sys.modules) - before)
        bad = [m for m in new if any(w in m.lower() for w in ("pallas", "triton", "mosaic"))]
        print("bad:", bad)
        """
    )
    path = ROOT / "pallas_kernels" / "paged_attention" / "tiling.py"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "bad: []"


@pytest.mark.parametrize(
    ("num_seqs", "max_steps", "want"),
    [(1, 64, 33), (16, 64, 3), (64, 64, 1), (256, 64, 1), (1, 4, 4), (1, 1, 1), (0, 8, 8)],
)
def test_kv_splits_fill_the_sms_and_no_more(num_seqs, max_steps, want):
    """Llama-3-8B's 8 KV heads on an H100's 132 SMs: a small batch is split until its
    programs give every SM two (batch 1: 33 splits, batch 16: 3), a batch that fills them
    alone is not split (batch 64 and up: no partials, no merge), and never into more splits
    than the block table has steps."""
    got = plan_kv_splits(num_seqs=num_seqs, num_kv_heads=8, max_steps=max_steps, num_sms=132)
    assert got == want
    assert plan_kv_splits(num_seqs=1, num_kv_heads=1, max_steps=1000, num_sms=132) == 64


def test_smem_estimate_rejects_the_decode_tiling_that_failed_on_the_h100():
    """The H100 (jax 0.11.2) refused the fp32, head_dim 128 decode kernel with 128 KV tokens
    per step in 2 stages: `Shared memory size limit exceeded: requested 270336, available:
    232448`. The estimate gives that figure, and the plan refuses the tiling."""
    assert smem_bytes(rows=16, head_dim=128, kv_tokens=128, num_stages=2, itemsize=4) == 270336
    assert HOPPER_SMEM_BYTES == 232448
    with pytest.raises(ValueError, match=r"float32, head_dim 128 .* 270336 B, 232448 B"):
        plan_tiles("decode", dtype=jnp.float32, head_dim=128, block_size=16, rows=16,
                   kv_tokens=128, num_stages=2)  # fmt: skip


# (kernel, dtype, head_dim) -> (KV tokens per step, pipeline stages) the kernel picks, at
# block_size 16, GQA groups up to 16 (decode) and q_block 64 (mixed).
PICKS = {
    ("decode", "float32", 64): (128, 2),
    ("decode", "float32", 128): (64, 2),
    ("decode", "float32", 256): (32, 2),
    ("decode", "bfloat16", 64): (128, 2),
    ("decode", "bfloat16", 128): (128, 2),
    ("decode", "bfloat16", 256): (64, 2),
    ("mixed", "float32", 64): (64, 2),
    ("mixed", "float32", 128): (64, 2),
    ("mixed", "float32", 256): (32, 2),
    ("mixed", "bfloat16", 64): (64, 2),
    ("mixed", "bfloat16", 128): (64, 2),
    ("mixed", "bfloat16", 256): (64, 2),
}


@pytest.mark.parametrize(("kernel", "dtype", "head_dim"), list(PICKS))
@pytest.mark.parametrize("block_size", [16, 32])
def test_picked_tilings_fit_hopper_shared_memory(kernel, dtype, head_dim, block_size):
    """What the kernel picks fits 232448 B, with room left for a float32 score tile
    [rows, KV tokens] should Triton stage one through shared memory too."""
    rows = 16 if kernel == "decode" else 64
    plan = plan_tiles(kernel, dtype=dtype, head_dim=head_dim, block_size=block_size, rows=rows)
    tokens = plan.pages_per_step * block_size
    if block_size == 16:
        assert (tokens, plan.num_stages) == PICKS[kernel, dtype, head_dim]
    itemsize = jnp.dtype(dtype).itemsize
    assert plan.smem_bytes == smem_bytes(rows=rows, head_dim=head_dim, kv_tokens=tokens,
                                         num_stages=plan.num_stages, itemsize=itemsize)  # fmt: skip
    assert plan.smem_bytes + rows * tokens * 4 <= HOPPER_SMEM_BYTES


def test_explicit_tilings_are_kept_and_checked():
    plan = plan_tiles("decode", dtype=jnp.bfloat16, head_dim=128, block_size=16, rows=16,
                      kv_tokens=64, num_stages=3)  # fmt: skip
    assert plan[:2] == (4, 3)
    # Tokens given, stages free: the stages drop until it fits.
    plan = plan_tiles("decode", dtype=jnp.float32, head_dim=128, block_size=16, rows=16,
                      kv_tokens=128)  # fmt: skip
    assert plan[:2] == (8, 1)


def test_rejects_shapes_no_tiling_fits():
    """fp32 head_dim 256 in 256-token pages: one page of K and V alone is over the limit."""
    with pytest.raises(ValueError, match=r"float32, head_dim 256 .* 540672 B, 232448 B"):
        plan_tiles("decode", dtype=jnp.float32, head_dim=256, block_size=256, rows=16)


def test_a_call_is_planned_from_its_shapes():
    """Llama-3-8B heads (Hq 32, Hkv 8, D 128) in 16-token pages, up to 512 pages per sequence,
    132 SMs: batch 1 decodes split 33 ways; 4 query tokens make one 64-row tile per KV head,
    split 33 ways too; 1024 tokens fill the SMs with tiles (unsplit) and 4 sequences take 9
    decode splits. bf16 keeps 128 decode tokens per step, fp32 halves them (shared memory)."""
    q, cache, bf16 = (1, 32, 128), (9, 16, 8, 128), jnp.bfloat16
    plan = plan_attention(q, cache, (1, 512), dtype=bf16, decode_only=True, q_block=64,
                          num_sms=132)  # fmt: skip
    assert plan == (TilePlan(8, 2, 135168), None, 33, None)
    plan = plan_attention((4, 32, 128), cache, (1, 512), dtype=bf16, decode_only=False,
                          q_block=64, num_sms=132)  # fmt: skip
    assert (plan.mixed[:2], plan.num_kv_splits, plan.mixed_kv_splits) == ((4, 2), 33, 33)
    plan = plan_attention((1024, 32, 128), cache, (4, 512), dtype=jnp.float32,
                          decode_only=False, q_block=64, num_sms=132)  # fmt: skip
    assert (plan.decode[:2], plan.num_kv_splits, plan.mixed_kv_splits) == ((4, 2), 9, 1)
    # Given splits are kept; shapes the lowering cannot tile are refused first.
    plan = plan_attention(q, cache, (1, 512), dtype=bf16, decode_only=True, q_block=64,
                          num_kv_splits=3, num_sms=132)  # fmt: skip
    assert plan.num_kv_splits == 3
    with pytest.raises(ValueError, match="q_block=8 must be at least 16"):
        plan_attention(q, cache, (1, 512), dtype=bf16, decode_only=True, q_block=8)


def test_the_batch_is_divided_between_the_kernels():
    """Sequences of 3, 1 and 70 query tokens and a padding one (num_seqs 3), GQA group 2,
    64-row tiles: the decode kernel takes the single-token sequence (every real one when the
    caller promises decode_only); the mixed kernel gives 6 rows one tile and 140 rows three,
    of the 3 + 4 tiles 76 tokens can need."""
    query_start_loc = jnp.array([0, 3, 4, 74, 76], jnp.int32)
    num_seqs = jnp.array([3], jnp.int32)
    single = decode_seqs(query_start_loc, num_seqs, decode_only=False)
    np.testing.assert_array_equal(single, [False, True, False, False])
    every = decode_seqs(query_start_loc, num_seqs, decode_only=True)
    np.testing.assert_array_equal(every, [True, True, True, False])
    tile_seq, tile_row = assign_tiles(query_start_loc, num_seqs, num_tokens=76, group=2,
                                      q_block=64)  # fmt: skip
    np.testing.assert_array_equal(tile_seq, [0, 2, 2, 2, -1, -1, -1])
    np.testing.assert_array_equal(tile_row[:4], [0, 0, 64, 128])
