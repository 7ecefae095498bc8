"""The Mosaic GPU paged-attention kernel (`pallas_kernels/paged_attention/mosaic.py`).

- Its tiling arithmetic (`mosaic_tiling.py`) as plain Python.
- Numerics on CPU: the kernel itself run by Mosaic GPU's interpreter (TMA copies, barriers,
  wgmma, the persistent loop and the XLA merge of KV splits all executed; uninitialised
  shared memory reads as NaN there, so a step that reads a buffer its copy has not filled
  shows) against the dense float64 oracle and the jnp reference, in bf16 at the Triton
  kernel's bf16 tolerance. float32 is refused by design (wgmma would run it as tf32).
- `cuda_lowering`: the kernel lowered for CUDA on this CPU machine at Llama-3-8B's shapes
  (Pallas -> Mosaic GPU lowering, layout inference and the shared-memory check all run; the
  PTX compile does not).
- `gpu`: the kernel against the reference on a real Hopper GPU.
"""

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.paged_attention import mosaic, ragged_paged_attention_reference
from pallas_kernels.paged_attention import mosaic_tiling as mt
from pallas_kernels.paged_attention.mosaic import interpret_params, ragged_paged_attention
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.paged_cases import make_case, naive_attention

ROOT = Path(__file__).resolve().parents[2]
BF16 = ml_dtypes.bfloat16
# (q_len, kv_len): decodes at kv 1, a block multiple and not, a long one (several steps);
# prompts and chunks that start mid-sequence, one over several 64-row tiles.
MIXED = [(1, 1), (1, 32), (1, 45), (7, 7), (5, 37), (1, 300), (40, 40), (24, 100)]
DECODE = [(1, 1), (1, 32), (1, 45), (1, 300), (1, 17), (1, 64)]
LAYOUTS = {"mixed": MIXED, "decode": DECODE}


# ---------------------------------------------------------------- tiling arithmetic (no jax)


def test_pages_per_step_makes_whole_pages_of_a_multiple_of_64_keys():
    assert mt.pages_per_step(16) == 4  # the default 64 keys
    assert mt.pages_per_step(32) == 2
    assert mt.pages_per_step(8) == 8
    assert mt.pages_per_step(128) == 1 and mt.pages_per_step(256) == 1  # one page, whole
    assert mt.pages_per_step(16, 128) == 8
    assert mt.pages_per_step(16, 10) == 4  # never under 64 keys (the PV wgmma's K tile)
    with pytest.raises(ValueError, match="96 keys per step"):
        mt.pages_per_step(32, 96)
    with pytest.raises(ValueError, match="512 keys"):
        mt.pages_per_step(16, 512)  # over the QK wgmma's N


def test_smem_estimate_and_stages():
    """The buffers the kernel allocates, and the most stages (up to 4) within 227 KiB."""
    # bf16, D 128, 64 keys, split (f32 output tile): 4 x 32 KiB of K/V + q 16 KiB + p 8 KiB
    # + o 32 KiB + 1 KiB of row vectors + 9 barriers.
    assert mt.smem_bytes(head_dim=128, kv_tokens=64, num_stages=4, itemsize=2, split=True) == (
        4 * 2 * 64 * 128 * 2 + 64 * 128 * 2 + 64 * 64 * 2 + 64 * 128 * 4 + 1024 + 9 * 8
    )
    stages = functools.partial(mt.plan_stages, itemsize=2)
    assert stages(head_dim=128, kv_tokens=64, split=True) == 4
    assert stages(head_dim=64, kv_tokens=128, split=False) == 4
    assert stages(head_dim=64, kv_tokens=256, split=False) == 2  # 3 x 64 KiB + 32 KiB of p
    assert stages(head_dim=128, kv_tokens=256, split=True) == 1
    assert stages(head_dim=256, kv_tokens=64, split=False) == 2
    assert stages(head_dim=256, kv_tokens=64, split=True) == 1  # the f32 tile costs a stage
    assert stages(head_dim=256, kv_tokens=64, split=True, num_stages=1) == 1
    with pytest.raises(ValueError, match="head_dim 256, 64 keys per step in 2 stage"):
        stages(head_dim=256, kv_tokens=64, split=True, num_stages=2)  # given: kept, checked
    with pytest.raises(ValueError, match="shared memory"):
        stages(head_dim=512, kv_tokens=256, split=True)  # not even one stage fits
    with pytest.raises(ValueError, match="at least 1"):
        stages(head_dim=64, kv_tokens=64, split=False, num_stages=0)


def test_kv_splits_fill_the_sms_and_stop_where_the_batch_does():
    split = functools.partial(mt.plan_kv_splits, num_kv_heads=8, num_sms=132)
    assert split(num_tiles=1, max_steps=128) == 33  # 264 items: two per SM
    assert split(num_tiles=16, max_steps=128) == 3
    assert split(num_tiles=33, max_steps=128) == 1  # the batch fills the SMs alone
    assert split(num_tiles=1, max_steps=5) == 5  # never past the block table's steps
    assert mt.plan_kv_splits(num_tiles=1, num_kv_heads=1, max_steps=999, num_sms=132) == 64
    assert mt.num_programs(num_work=264, num_sms=132) == 132  # persistent: one per SM
    assert mt.num_programs(num_work=5, num_sms=132) == 5
    assert mt.num_programs(num_work=0, num_sms=132) == 1


def test_tiles_cover_every_row_of_a_sequence():
    assert mt.tiles_per_sequence(1, 4) == 1  # a decode: its 4 heads padded to 64 rows
    assert mt.tiles_per_sequence(1, 128) == 2
    assert mt.tiles_per_sequence(40, 4) == 3  # 160 rows
    assert mt.tiles_per_sequence(0, 4) == 0
    assert mt.max_tiles(num_tokens=64, group=4, max_seqs=64, decode_only=True) == 64
    # 100 tokens in up to 3 sequences: 400 rows, each sequence's last tile partial
    assert mt.max_tiles(num_tokens=100, group=4, max_seqs=3, decode_only=False) == 7 + 3
    lens = [37, 1, 62]  # any split of 100 tokens fits the bound
    assert sum(mt.tiles_per_sequence(n, 4) for n in lens) <= 10


def test_plan_checks_shapes_and_plans_llama_decode():
    plan = functools.partial(
        mt.plan, num_tokens=1, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        max_seqs=1, max_blocks=512, itemsize=2, decode_only=True,
    )  # fmt: skip
    p = plan()
    assert p == mt.MosaicPlan(4, 4, 33, 132, p.smem_bytes) and p.smem_bytes <= 232448
    assert plan(num_kv_splits=1).num_programs == 8  # one tile x 8 heads
    with pytest.raises(ValueError, match="head_dim=96"):
        plan(head_dim=96)
    with pytest.raises(ValueError, match="block_size=4"):
        plan(block_size=4)
    with pytest.raises(ValueError, match="block_size=24"):
        plan(block_size=24)
    with pytest.raises(ValueError, match="Hq=32 is not a multiple of Hkv=6"):
        plan(num_kv_heads=6)


def test_tiling_module_imports_no_jax_and_the_kernel_needs_mosaic_gpu():
    """mosaic_tiling.py loads without jax; mosaic.py raises ImportError (naming the module)
    on a jax without Mosaic GPU, for the engine's guard to catch."""
    script = textwrap.dedent(f"""
        import importlib.util, sys
        path = {str(ROOT / "pallas_kernels/paged_attention/mosaic_tiling.py")!r}
        spec = importlib.util.spec_from_file_location("mosaic_tiling", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        assert "jax" not in sys.modules, "mosaic_tiling imported jax"
        sys.modules["jax.experimental.pallas.mosaic_gpu"] = None  # as if jax had none
        try:
            import pallas_kernels.paged_attention.mosaic
        except ImportError as e:
            assert e.name == "jax.experimental.pallas.mosaic_gpu", e.name
            print("ok")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ---------------------------------------------------------------- numerics (interpret mode)


def _case(layout, heads=(8, 2), head_dim=64, block_size=16, dtype=BF16, seed=0):
    hq, hkv = heads
    return make_case(
        LAYOUTS[layout], num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype, pad_tokens=3, pad_seqs=2, seed=seed,
    )  # fmt: skip


def _args(case, dtype=jnp.bfloat16):
    return [jnp.asarray(a, dtype) if i < 3 else jnp.asarray(a) for i, a in enumerate(case.args())]


def _check(case, layout, *, window=None, soft_cap=None, sinks=None, interpret=True, **tuning):
    """The kernel against the float64 oracle and the jnp reference (bf16 tolerance), its
    padding rows zero."""
    scale = case.q.shape[-1] ** -0.5
    kw = dict(sliding_window=window, soft_cap=soft_cap, decode_only=layout == "decode",
              sinks=None if sinks is None else jnp.asarray(sinks))  # fmt: skip
    out = ragged_paged_attention(*_args(case), sm_scale=scale, interpret=interpret, **kw, **tuning)
    out = np.asarray(out, np.float32)
    assert out.shape == case.q.shape
    want = naive_attention(case, scale, window, soft_cap, sinks)
    np.testing.assert_allclose(out, want, atol=2e-2)
    ref = ragged_paged_attention_reference(*_args(case), sm_scale=scale, **kw)
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=2e-2)
    assert not out[-3:].any()  # padding rows are zero
    return out


@pytest.mark.parametrize("heads", [(8, 2), (12, 1), (2, 2)])
def test_interpret_decode_matches_oracle(heads):
    """Decode-only, one tile per sequence, 2 stages over up to 5 steps, two persistent
    programs looping over the work items. Only the group's rows travel, rounded up to 8
    (GQA 4 and MHA: 8 of the tile's 64 rows; GQA 12: 16), the rest of the tile padding."""
    case = _case("decode", heads, seed=1)
    _check(case, "decode", num_kv_splits=1, num_stages=2, num_sms=2)
    _check(case, "decode", num_kv_splits=2, num_stages=1, num_sms=3)


@pytest.mark.parametrize("layout", ["decode", "mixed"])
def test_interpret_block_map_reads_a_layers_share_of_the_cache(layout):
    """block_map (scale, shift): table entry b is cache block b * scale + shift, as a layer
    of a several-layer cache (shift) packed two to a row (scale) reads it; every other block
    holds garbage that would show."""
    case = _case(layout, seed=6)
    n = case.k_cache.shape[0]
    scale = case.q.shape[-1] ** -0.5
    kw = dict(sm_scale=scale, decode_only=layout == "decode", interpret=True)
    q, k, v, *rest = _args(case)
    want = ragged_paged_attention(q, k, v, *rest, **kw)
    rows = 2 * np.arange(n) + n + 1
    k_big, v_big = (jnp.full((3 * n + 1, *x.shape[1:]), 60.0, x.dtype).at[rows].set(x)
                    for x in (k, v))  # fmt: skip
    block_map = jnp.array([2, n + 1], jnp.int32)
    got = ragged_paged_attention(q, k_big, v_big, *rest, None, block_map, **kw)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [((8, 2), 64, 16), ((3, 1), 128, 32)])
def test_interpret_mixed_matches_oracle(heads, head_dim, block_size):
    """Prefill chunks and decodes in one batch: GQA 4, and GQA 3 whose 64-row tiles end
    mid-token; 4 and 2 pages a step."""
    _check(_case("mixed", heads, head_dim, block_size, seed=2), "mixed", num_kv_splits=1,
           num_sms=3)  # fmt: skip


@pytest.mark.parametrize("layout", ["decode", "mixed"])
def test_interpret_split_keys_match_oracle(layout):
    """Each tile's keys split over 3 programs (single-step contexts leave splits empty),
    the float32 partials merged in XLA."""
    _check(_case(layout, seed=3), layout, num_kv_splits=3, num_stages=1, num_sms=5)


def test_interpret_sliding_window_and_soft_cap_match_oracle():
    """A window of a few pages, not block-aligned (pages before a tile's window are not
    read), and a soft cap small enough to change every score; split over 2."""
    _check(_case("mixed", seed=4), "mixed", window=37, soft_cap=1.0, num_kv_splits=2)


@pytest.mark.parametrize("splits", [1, 2])
def test_interpret_sinks_match_oracle(splits):
    """gpt-oss's sinks with its window: added in the kernel (one split) or in the merge."""
    sinks = np.linspace(-2.0, 6.0, 8).astype(np.float32)
    _check(_case("mixed", seed=5), "mixed", window=37, sinks=sinks, num_kv_splits=splits)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_interpret_pipeline_has_no_races(layout):
    """The interpreter's race detector (TMA copies against the reads of the buffers they
    fill) finds none in a pipelined, persistent, split run: 2 stages over 3-step contexts,
    128 keys a step, 3 programs over the work items (decode: the group's 8 rows copied into
    the tile's first rows, and out of them)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    params = interpret_params(detect_races=True)
    case = _case(layout, seed=6)
    _check(case, layout, interpret=params, num_kv_splits=2, num_stages=2,
           kv_tokens_per_step=128, num_sms=3)  # fmt: skip
    assert gpu_callbacks.get_races().races_found is False


def test_direct_path_takes_whole_8_row_tiles_of_q():
    assert [mosaic.direct_rows(g) for g in (1, 2, 4, 8, 12, 3, 6, 16, 60, 63)] == [
        8, 8, 8, 8, 16, 16, 16, 16, 64, 72,
    ]  # fmt: skip
    assert mosaic.direct_fits(6 * 8, 4) and mosaic.direct_fits(256 * 32, 4)
    assert not mosaic.direct_fits(6 * 2, 1)  # 12 rows: not whole tiles
    assert not mosaic.direct_fits(8, 12)  # 16 rows needed, 8 there
    assert not mosaic.direct_fits(4096, 63)  # over one wgmma tile


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("heads", [(8, 2), (8, 8), (12, 1)])
def test_interpret_direct_decode_reads_and_writes_q_in_place(heads, splits):
    """A decode reads each group's rows from q in place (no XLA gather of q); unsplit it
    writes its output rows in place too, split 2 ways its partials go to XLA's merge. With
    no padding token, the last token's last group ends q: its tile's rows start before the
    group's (GQA 4: 8 rows from 4 before; GQA 12: 16 from 4 before; MHA: 8 from 7 before),
    and only the group's rows are written (taken). Race-checked (3 programs, two-stage
    pipeline)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    hq, hkv = heads
    assert mosaic.direct_fits(len(DECODE) * hq, hq // hkv)
    case = make_case(DECODE, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=16,
                     dtype=BF16, seed=7)  # fmt: skip
    scale = 64**-0.5
    out = ragged_paged_attention(
        *_args(case), sm_scale=scale, decode_only=True, num_kv_splits=splits, num_stages=2,
        num_sms=3, interpret=interpret_params(detect_races=True),
    )  # fmt: skip
    assert gpu_callbacks.get_races().races_found is False
    np.testing.assert_allclose(
        np.asarray(out, np.float32), naive_attention(case, scale, None, None, None), atol=2e-2
    )


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads", [(8, 2), (16, 2), (24, 2)])
def test_interpret_direct_decode_with_sinks(heads, splits):
    """gpt-oss's sinks (and window) on the direct path: each tile's rows take the sinks of
    their query heads from the wrapped table at its first row's head (GQA 4 and 8 from an
    aligned row; GQA 12: 16 rows from 4 before the group, the last token's last group
    clamped to q's end); split 3 ways, the partials merged with the sinks in XLA where the
    kernel wrote them and each group's rows gathered from its tile. Race-checked."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    hq, hkv = heads
    assert mosaic.direct_fits(len(DECODE) * hq, hq // hkv)
    case = make_case(DECODE, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=16,
                     dtype=BF16, seed=8)  # fmt: skip
    sinks = np.linspace(-2.0, 6.0, hq).astype(np.float32)
    scale = 64**-0.5
    out = ragged_paged_attention(
        *_args(case), jnp.asarray(sinks), sm_scale=scale, sliding_window=37, decode_only=True,
        num_kv_splits=splits, num_stages=2, num_sms=3,
        interpret=interpret_params(detect_races=True),
    )  # fmt: skip
    assert gpu_callbacks.get_races().races_found is False
    np.testing.assert_allclose(
        np.asarray(out, np.float32), naive_attention(case, scale, 37, None, sinks), atol=2e-2
    )


def test_refuses_what_it_does_not_implement():
    """float32 (tf32 on wgmma), fp8 caches, attention chunks and MLA name the Triton
    kernel; shapes it cannot tile raise ValueError."""
    case = _case("decode")
    scale = dict(sm_scale=0.125)
    with pytest.raises(NotImplementedError, match="kernel.ragged_paged_attention"):
        ragged_paged_attention(*_args(case, jnp.float32), **scale)
    fp8 = _args(case)
    fp8[1], fp8[2] = fp8[1].astype(jnp.float8_e4m3fn), fp8[2].astype(jnp.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="Triton"):
        ragged_paged_attention(*fp8, **scale)
    with pytest.raises(NotImplementedError, match="attention_chunk.*kernel.ragged"):
        ragged_paged_attention(*_args(case), **scale, attention_chunk=64)
    with pytest.raises(NotImplementedError, match="MLA"):
        ragged_paged_attention(*_args(case), **scale, latent_dim=32)
    odd = make_case([(1, 4)], num_q_heads=4, num_kv_heads=2, head_dim=48, block_size=16)
    with pytest.raises(ValueError, match="head_dim=48"):
        ragged_paged_attention(*_args(odd), **scale)


# ---------------------------------------------------------------- lowering for CUDA (no GPU)


def _llama_args(num_seqs: int, max_blocks: int, num_tokens: int):
    """Abstract bf16 inputs at Llama-3-8B's attention shapes: 32 q heads, 8 KV heads, D 128,
    16-token pages."""
    spec, i32 = jax.ShapeDtypeStruct, jnp.int32
    cache = spec((num_seqs * max_blocks + 1, 16, 8, 128), jnp.bfloat16)
    return (
        spec((num_tokens, 32, 128), jnp.bfloat16), cache, cache, spec((num_seqs,), i32),
        spec((num_seqs, max_blocks), i32), spec((num_seqs + 1,), i32), spec((1,), i32),
    )  # fmt: skip


def _mosaic_results(args, **kw) -> list[str]:
    """Lower for CUDA; the result types of each Mosaic GPU custom call of the step."""
    f = functools.partial(ragged_paged_attention, sm_scale=128**-0.5, **kw)
    text = lower_for_cuda(f, *args)
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    return [line.rsplit(" -> ", 1)[1] for line in calls]


@pytest.mark.cuda_lowering
@pytest.mark.parametrize(
    ("num_seqs", "max_blocks", "results"),
    [
        (1, 512, "(tensor<33x1x8x8x128xf32>, tensor<33x1x8x8xf32>, tensor<33x1x8x8xf32>)"),
        # 512 items fill the SMs: no split, each group's 4 rows written in q's [T * 32] rows
        (64, 128, "tensor<2048x128xbf16>"),
    ],
)
def test_decode_lowers_for_cuda_at_llama_shapes(num_seqs, max_blocks, results):
    """Batch 1 at 8192 tokens of context splits 33 ways (two items per SM, float32
    partials); batch 64 is not split and writes bf16 rows. A decode tile's 4 heads travel
    as 8 rows (whole 8-row tiles of shared memory), not the wgmma tile's 64; unsplit, they
    are read from q and written to the output in place (the direct path: no XLA gathers)."""
    args = _llama_args(num_seqs, max_blocks, num_seqs)
    assert _mosaic_results(args, decode_only=True, num_sms=132) == [results]
    # gpt-oss's sinks and window on the same path (the sinks from a wrapped table)
    sinks = jnp.zeros((32,), jnp.float32)
    kw = dict(decode_only=True, num_sms=132, sliding_window=128)
    assert _mosaic_results((*args[:7], sinks), **kw) == [results]


@pytest.mark.cuda_lowering
@pytest.mark.parametrize(
    "features",
    [{}, dict(sliding_window=4096, soft_cap=50.0, sinks=jnp.zeros((32,), jnp.float32))],
)
def test_mixed_lowers_for_cuda_at_llama_shapes(features):
    """1024 tokens over 8 sequences (prefill chunks and decodes): 72 tiles, unsplit; and
    4 tokens over 4096 keys (a speculative verification), split."""
    tiles = 1024 * 4 // 64 + 8
    args = _llama_args(8, 256, 1024)
    assert _mosaic_results(args, num_sms=132, **features) == [f"tensor<{tiles}x8x64x128xbf16>"]
    (results,) = _mosaic_results(_llama_args(1, 256, 4), num_sms=132, **features)
    assert results.startswith("(tensor<33x2x8x64x128xf32>")


@pytest.mark.cuda_lowering
def test_smem_estimate_agrees_with_mosaic():
    """D 256 with split (float32) partials: the planned single stage lowers; two stages,
    over the estimate's 227 KiB when forced past the plan's check, are refused by Mosaic's
    own shared-memory check too (the estimate does not undercount)."""
    spec, i32 = jax.ShapeDtypeStruct, jnp.int32
    cache = spec((65, 16, 2, 256), jnp.bfloat16)
    args = (spec((1, 8, 256), jnp.bfloat16), cache, cache, spec((1,), i32), spec((1, 64), i32),
            spec((2,), i32), spec((1,), i32))  # fmt: skip
    kw = dict(decode_only=True, num_kv_splits=2)
    assert len(_mosaic_results(args, **kw)) == 1
    assert mt.smem_bytes(head_dim=256, kv_tokens=64, num_stages=2, itemsize=2, split=True) > (
        mt.HOPPER_SMEM_BYTES
    )
    with pytest.raises(ValueError, match="Mosaic GPU kernel exceeds available shared memory"):
        _mosaic_results(args, **kw, num_stages=2, smem_limit=10**6)


# ---------------------------------------------------------------- real GPU


def _needs_hopper():
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", "0")
    if float(capability) < 9.0:
        pytest.skip(f"Mosaic GPU needs sm_90 or newer, this GPU is sm_{capability}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize(
    "tuning",
    [{}, dict(num_kv_splits=1), dict(num_kv_splits=3), dict(num_stages=1, num_sms=7)],
)
def test_gpu_matches_oracle(layout, tuning):
    _needs_hopper()
    for heads, block_size in (((32, 8), 16), ((3, 1), 64)):
        case = _case(layout, heads, 128, block_size, seed=block_size)
        _check(case, layout, interpret=False, **tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2])
def test_gpu_window_soft_cap_and_sinks_match_oracle(splits):
    _needs_hopper()
    sinks = np.linspace(-2.0, 6.0, 8).astype(np.float32)
    case = _case("mixed", seed=7)
    _check(case, "mixed", window=37, soft_cap=30.0, sinks=sinks, interpret=False,
           num_kv_splits=splits)  # fmt: skip
