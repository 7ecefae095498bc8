"""pallas_kernels/grouped_matmul/mosaic.py: the Mosaic GPU grouped matmul that decodes packed
experts inside the kernel gives ragged_dot's result on the decoded weights, run by Mosaic GPU's
interpreter on CPU (every code each format can hold, empty groups, a group across two 64-row
blocks, rows past the groups zero); it lowers for CUDA at Qwen3-30B-A3B's shapes (jax >= 0.11);
on a GPU, the engine's choice with JAXSERVE_MOE_KERNEL=mosaic runs it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gmm
from pallas_kernels.grouped_matmul.packed import Packed
from tests.pallas_kernels.cuda import lower_for_cuda

mosaic = pytest.importorskip("pallas_kernels.grouped_matmul.mosaic")

GROUP = {"mxfp4": 32, "int4": 32, "fp8_block": 64, "gguf": 32}
NEW_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def _packed(mode: str, e: int, k: int, n: int, rng) -> Packed:
    """Experts [e, k, n] packed as `mode`, their codes cycling through every byte value."""
    g = GROUP[mode]
    rows = k // 2 if mode in ("mxfp4", "int4") else k
    codes = np.arange(256, dtype=np.uint8)
    if mode == "fp8_block":
        codes = codes[(codes & 0x7F) != 0x7F]  # not the NaNs
    codes = np.resize(rng.permutation(codes), (e, rows, n))
    dtype = {"fp8_block": jnp.float8_e4m3fn, "gguf": jnp.int8}.get(mode, jnp.uint8)
    kernel = jnp.asarray(codes).view(dtype)
    if mode == "mxfp4":
        scale = jnp.asarray(rng.integers(120, 130, (e, k // g, n)), jnp.uint8)
    else:
        scale = jnp.asarray(rng.uniform(0.01, 0.05, (e, k // g, n)), jnp.float32)
    offset = None
    if mode in ("int4", "gguf"):
        offset = jnp.asarray(rng.normal(size=(e, k // g, n)) * 0.05, jnp.float32)
    return Packed(kernel, scale, offset, g)


@pytest.mark.parametrize("mode", ["dense", "mxfp4", "int4", "fp8_block", "gguf"])
def test_interpreted_kernel_equals_ragged_dot(mode):
    rng = np.random.default_rng(len(mode))
    e, k, n = 4, 128, 128
    if mode == "dense":
        w = jnp.asarray(rng.normal(size=(e, k, n)) * 0.05, jnp.bfloat16)
        dense = w.astype(jnp.float32)
    else:
        w = _packed(mode, e, k, n, rng)
        dense = w.dense(jnp.float32)
    groups = jnp.asarray([3, 0, 70, 1], jnp.int32)  # group 2 spans rows 3-72: two blocks
    x = jnp.asarray(rng.normal(size=(80, k)), jnp.bfloat16)
    run = functools.partial(mosaic.grouped_matmul_mosaic, block_n=64, num_programs=3)
    got = np.asarray(run(x, w, groups, interpret=True), np.float32)
    want = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), dense, groups))
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max(), rtol=1e-2)
    assert not got[74:].any()


def test_tiles_only_for_groups_with_rows():
    """The work list: a tile per (group, 64-row block) it touches; empty groups get none, so
    their experts are never read; no rows at all, no tiles and zeros out."""
    table, bound = mosaic.tile_table(jnp.asarray([3, 0, 70, 1], jnp.int32), 80)
    live = [tuple(r) for r in np.asarray(table).tolist() if r[0] >= 0]
    # (group, block, first row in the block, rows): group 2 spans blocks 0 and 1
    assert live == [(0, 0, 0, 3), (2, 0, 3, 61), (2, 1, 0, 9), (3, 1, 9, 1)]
    assert bound >= len(live)
    table, _ = mosaic.tile_table(jnp.zeros((4,), jnp.int32), 5)
    assert (np.asarray(table)[:, 0] == -1).all()
    w = _packed("mxfp4", 4, 128, 64, np.random.default_rng(0))
    x = jnp.ones((5, 128), jnp.bfloat16)
    got = mosaic.grouped_matmul_mosaic(x, w, jnp.zeros((4,), jnp.int32), block_n=64, interpret=True)
    assert got.shape == (5, 64) and not np.asarray(got, np.float32).any()


def test_a_k_ending_inside_a_step_is_left_to_the_gpu():
    """gpt-oss's K = 2880 is 22.5 steps of 64 packed MXFP4 rows: on a GPU the last step's
    copies read zeros past K (TMA), which the interpreter refuses: the call names K there;
    scale groups cut by K are refused everywhere (`fits` says no: XLA's ragged_dot runs)."""
    w = Packed(jnp.zeros((2, 1440, 128), jnp.uint8), jnp.zeros((2, 90, 128), jnp.uint8), None, 32)
    x = jnp.zeros((4, 2880), jnp.bfloat16)
    assert mosaic.fits(x, w)
    with pytest.raises(ValueError, match="K=2880 ends inside a step"):
        mosaic.grouped_matmul_mosaic(x, w, jnp.asarray([4, 0], jnp.int32), interpret=True)
    cut = Packed(jnp.zeros((2, 40, 128), jnp.uint8), jnp.zeros((2, 1, 128), jnp.uint8), None, 64)
    assert not mosaic.fits(x[:, :80], cut)


def _qwen3_weights(mode: str):
    spec = jax.ShapeDtypeStruct
    e, k, n = 128, 2048, 1536  # w13 of Qwen3-30B-A3B
    if mode == "dense":
        return spec((e, k, n), jnp.bfloat16)
    g = {"mxfp4": 32, "int4": 128, "fp8_block": 128, "gguf": 32}[mode]
    rows = k // 2 if mode in ("mxfp4", "int4") else k
    dtype = {"fp8_block": jnp.float8_e4m3fn, "gguf": jnp.int8}.get(mode, jnp.uint8)
    scale = spec((e, k // g, n), jnp.uint8 if mode == "mxfp4" else jnp.float32)
    offset = spec((e, k // g, n), jnp.float32) if mode in ("int4", "gguf") else None
    return Packed(spec((e, rows, n), dtype), scale, offset, g)


@pytest.mark.cuda_lowering
@pytest.mark.skipif(not NEW_JAX, reason="the kernel's layouts need jax >= 0.11's Mosaic GPU")
@pytest.mark.parametrize("mode", ["dense", "mxfp4", "int4", "fp8_block", "gguf"])
def test_lowers_for_cuda_at_qwen3_shapes(mode):
    """Decode (8 tokens x top-8 = 64 rows over 128 experts): one Mosaic GPU kernel."""
    spec = jax.ShapeDtypeStruct
    f = functools.partial(mosaic.grouped_matmul_mosaic, num_programs=132)
    args = (spec((64, 2048), jnp.bfloat16), _qwen3_weights(mode), spec((128,), jnp.int32))
    text = lower_for_cuda(f, *args)
    assert sum("custom_call @mosaic_gpu" in line for line in text.splitlines()) == 1


@pytest.mark.cuda_lowering
@pytest.mark.skipif(not NEW_JAX, reason="the kernel's layouts need jax >= 0.11's Mosaic GPU")
def test_lowers_for_cuda_at_gpt_oss_shapes():
    """gpt-oss-20b's w13 in MXFP4 at batch 1 (4 rows over 32 experts; K = 2880 ends inside
    the 23rd step)."""
    spec = jax.ShapeDtypeStruct
    w = Packed(spec((32, 1440, 5760), jnp.uint8), spec((32, 90, 5760), jnp.uint8), None, 32)
    f = functools.partial(mosaic.grouped_matmul_mosaic, num_programs=132)
    args = (spec((4, 2880), jnp.bfloat16), w, spec((32,), jnp.int32))
    text = lower_for_cuda(f, *args)
    assert sum("custom_call @mosaic_gpu" in line for line in text.splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "mxfp4", "int4", "fp8_block", "mxfp4_tail"])
def test_gpu_engine_choice_runs_it(mode, monkeypatch):
    monkeypatch.setenv("JAXSERVE_MOE_KERNEL", "mosaic")
    rng = np.random.default_rng(3)
    k = 320 if mode == "mxfp4_tail" else 256  # 160 packed rows: 2.5 steps
    if mode == "dense":
        w = jnp.asarray(rng.normal(size=(8, k, 256)) * 0.05, jnp.bfloat16)
    else:
        w = _packed(mode.removesuffix("_tail"), 8, k, 256, rng)
    x = jnp.asarray(rng.normal(size=(128, k)), jnp.bfloat16)
    groups = jnp.asarray([1, 0, 30, 2, 0, 0, 60, 3], jnp.int32)
    assert gmm.choose(x, w) == "mosaic"
    got = np.asarray(jax.jit(gmm.grouped_matmul)(x, w, groups), np.float32)
    want = np.asarray(gmm.reference(x.astype(jnp.float32), w, groups), np.float32)
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max(), rtol=1e-2)
    assert not got[96:].any()
