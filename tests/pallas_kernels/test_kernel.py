"""The Pallas ragged paged-attention kernel against the dense oracle and the jnp reference.

On CPU the kernel runs in Pallas interpret mode (same kernel code, executed by XLA); the
`gpu`-marked tests run the same sweep compiled by Triton on a real GPU. A lowering test checks,
without a GPU, that every configuration of the sweep passes Pallas' Triton lowering (block
sizes, supported ops) for CUDA.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from tests.pallas_kernels.paged_cases import make_case, naive_attention

# (q_len, kv_len): decodes at kv 1, at an exact block multiple and not, a long one (several
# splits and steps); whole prompts and prefill chunks that start mid-sequence, long enough to
# need several query tiles.
MIXED = [(1, 1), (1, 32), (1, 45), (7, 7), (5, 37), (1, 300), (40, 40), (24, 100)]
DECODE = [(1, 1), (1, 32), (1, 45), (1, 300), (1, 17), (1, 64)]
LAYOUTS = {"mixed": MIXED, "decode": DECODE}

# head_dim x (Hq, Hkv) with GQA groups 1, 3, 4, 8 x block_size.
HEADS = [(2, 2), (3, 1), (8, 2), (8, 1)]
SWEEP = list(itertools.product([64, 128], HEADS, [16, 32]))


def _case(layout, head_dim, heads, block_size, dtype=np.float32, seed=0):
    hq, hkv = heads
    return make_case(
        LAYOUTS[layout], num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype, pad_tokens=3, pad_seqs=2, seed=seed,
    )  # fmt: skip


def _kernel(case, dtype=None, **kw):
    args = case.args()
    if dtype is not None:
        args = tuple(jnp.asarray(a, dtype) if i < 3 else a for i, a in enumerate(args))
    scale = case.q.shape[-1] ** -0.5
    return np.asarray(ragged_paged_attention(*args, sm_scale=scale, **kw), np.float32)


def _check_fp32(case, out):
    np.testing.assert_allclose(out, naive_attention(case, case.q.shape[-1] ** -0.5), atol=1e-5)
    assert not out[-3:].any()  # padding rows are zero


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize(("head_dim", "heads", "block_size"), SWEEP)
def test_interpret_matches_oracle_fp32(layout, head_dim, heads, block_size):
    case = _case(layout, head_dim, heads, block_size, seed=head_dim + sum(heads) + block_size)
    _check_fp32(case, _kernel(case, interpret=True))


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("heads", [(8, 2), (3, 1)])
def test_interpret_matches_reference_bf16(layout, heads):
    case = _case(layout, 128, heads, 16, dtype=ml_dtypes.bfloat16, seed=5)
    out = _kernel(case, jnp.bfloat16, interpret=True)
    args = tuple(jnp.asarray(a, jnp.bfloat16) if i < 3 else a for i, a in enumerate(case.args()))
    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=128**-0.5), np.float32)
    np.testing.assert_allclose(out, ref, atol=2e-2)
    np.testing.assert_allclose(out, naive_attention(case, 128**-0.5), atol=2e-2)


@pytest.mark.parametrize(
    "tuning",
    [
        dict(num_kv_splits=1, decode_pages_per_step=1),
        dict(num_kv_splits=3, decode_pages_per_step=4),
        dict(q_block=16, prefill_kv_tokens_per_step=16),
        dict(q_block=128, prefill_kv_tokens_per_step=128),
    ],
)
def test_tuning_arguments_do_not_change_the_result(tuning):
    for layout in ("mixed", "decode"):
        case = _case(layout, 64, (8, 2), 16, seed=11)
        _check_fp32(case, _kernel(case, interpret=True, **tuning))


def test_one_compile_serves_decode_and_mixed_batches():
    """The path is picked at run time: same shapes, another layout, no recompile."""
    mixed = _case("mixed", 64, (8, 2), 16, seed=1)
    n = len(DECODE)
    # A decode batch padded to the mixed case's shapes (same T, S, max_blocks, num_blocks).
    decode = make_case(DECODE, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=2)
    t, s = mixed.q.shape[0], mixed.kv_lens.shape[0]
    decode.q = np.concatenate([decode.q, np.zeros((t - n, 8, 64), np.float32)])
    pad_blocks = mixed.k_cache.shape[0] - decode.k_cache.shape[0]
    decode.k_cache = np.concatenate([decode.k_cache, np.ones((pad_blocks, 16, 2, 64), np.float32)])
    decode.v_cache = np.concatenate([decode.v_cache, np.ones((pad_blocks, 16, 2, 64), np.float32)])
    tables = np.zeros_like(mixed.block_tables)
    tables[:n, : decode.block_tables.shape[1]] = decode.block_tables
    decode.block_tables = tables
    decode.kv_lens = np.concatenate([decode.kv_lens, np.zeros(s - n, np.int32)])
    decode.query_start_loc = np.concatenate([np.arange(n + 1), np.full(s - n, n)]).astype(np.int32)

    _kernel(mixed, interpret=True)
    before = ragged_paged_attention._cache_size()
    out = _kernel(decode, interpret=True)
    assert ragged_paged_attention._cache_size() == before
    np.testing.assert_allclose(out, naive_attention(decode, 0.125), atol=1e-5)
    assert not out[n:].any()


def test_rejects_shapes_the_kernel_cannot_tile():
    case = make_case([(1, 4)], num_q_heads=4, num_kv_heads=2, head_dim=48, block_size=16)
    with pytest.raises(ValueError, match="head_dim=48"):
        _kernel(case, interpret=True)
    case = make_case([(1, 4)], num_q_heads=3, num_kv_heads=2, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="Hq=3"):
        _kernel(case, interpret=True)


@pytest.mark.parametrize(("head_dim", "heads", "block_size"), SWEEP)
def test_lowers_to_triton_for_cuda(head_dim, heads, block_size):
    """Without a GPU: both kernels pass Pallas' Triton lowering (power-of-two tensors, ops)."""
    case = _case("mixed", head_dim, heads, block_size)
    args = [jnp.asarray(a, jnp.bfloat16) if i < 3 else a for i, a in enumerate(case.args())]
    f = functools.partial(ragged_paged_attention, sm_scale=head_dim**-0.5)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # the decode and the mixed kernel


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize(("head_dim", "heads", "block_size"), SWEEP)
def test_gpu_matches_oracle(layout, head_dim, heads, block_size):
    case = _case(layout, head_dim, heads, block_size, seed=head_dim + sum(heads) + block_size)
    _check_fp32(case, _kernel(case))
    bf16 = _case(layout, head_dim, heads, block_size, dtype=ml_dtypes.bfloat16, seed=3)
    out = _kernel(bf16, jnp.bfloat16)
    np.testing.assert_allclose(out, naive_attention(bf16, head_dim**-0.5), atol=2e-2)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize(
    ("window", "soft_cap", "tuning"),
    [(1, None, {}), (37, None, dict(num_kv_splits=3)), (20, 1.0, {})],
)  # fmt: skip
def test_sliding_window_and_soft_cap_match_the_oracle(layout, window, soft_cap, tuning):
    """Windows shorter than a block, of a few blocks and not block-aligned (pages before a
    program's window are skipped: the decode splits share only the window's pages); soft caps
    small enough to change every score."""
    case = _case(layout, 64, (8, 2), 16, seed=window or 3)
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    out = _kernel(case, interpret=True, **kw, **tuning)
    np.testing.assert_allclose(out, naive_attention(case, 0.125, window, soft_cap), atol=1e-5)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=0.125, **kw)
    np.testing.assert_allclose(out, np.asarray(ref), atol=1e-5)


def test_window_and_soft_cap_lower_to_triton_for_cuda():
    case = _case("mixed", 64, (8, 2), 16)
    args = [jnp.asarray(a, jnp.bfloat16) if i < 3 else a for i, a in enumerate(case.args())]
    f = functools.partial(ragged_paged_attention, sm_scale=0.125, sliding_window=20, soft_cap=50.0)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


def _fp8_case(layout, dtype=ml_dtypes.float8_e4m3fn):
    """A case whose caches hold fp8 values (q stays float32)."""
    case = _case(layout, 64, (8, 2), 16, seed=11)
    case.k_cache, case.v_cache = case.k_cache.astype(dtype), case.v_cache.astype(dtype)
    return case


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_fp8_cache_matches_the_oracle_on_its_values(layout, dtype):
    """An fp8 cache (--kv-cache-dtype fp8) is widened as it is read: the kernel and the
    reference give the oracle's attention over the fp8 values themselves."""
    case = _fp8_case(layout, dtype)
    want = naive_attention(case, 0.125)  # the oracle reads the fp8 values exactly
    np.testing.assert_allclose(_kernel(case, interpret=True), want, atol=1e-5)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(ref), want, atol=1e-5)


def test_fp8_cache_lowers_to_triton_for_cuda():
    case = _fp8_case("mixed")
    args = [jnp.asarray(a) for a in case.args()]
    args[0] = args[0].astype(jnp.bfloat16)
    f = functools.partial(ragged_paged_attention, sm_scale=0.125)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_gpu_fp8_cache_matches_the_oracle(layout):
    case = _fp8_case(layout)
    np.testing.assert_allclose(_kernel(case), naive_attention(case, 0.125), atol=1e-4)
