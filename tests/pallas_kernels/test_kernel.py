"""The Pallas ragged paged-attention kernel against the dense oracle and the jnp reference.

On CPU the kernel runs in Pallas interpret mode (same kernel code, executed by XLA); the
`gpu`-marked tests run the same sweep compiled by Triton on a real GPU. Lowering tests check,
without a GPU, that every configuration of the sweep and every kernel variant (decode-only
and mixed, fp32 and bf16, head_dim 64 to 256) passes Pallas' Triton lowering (block sizes,
supported ops) for CUDA, each step holding the one kernel its layout asked for, with the
pipeline stages its tiling plans chose. The tiling arithmetic alone (no kernel) is
test_tiling.py's.
"""

import functools
import itertools
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.paged_attention import ragged_paged_attention_reference
from pallas_kernels.paged_attention.kernel import ragged_paged_attention
from pallas_kernels.paged_attention.tiling import HOPPER_SMEM_BYTES, plan_tiles
from tests.pallas_kernels.cuda import lower_for_cuda
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
# Interpreted (slow on CPU): every head_dim, GQA group and block size, each pair of head_dim and
# block size once; the GPU runs the whole SWEEP.
INTERPRET_SWEEP = [(64, HEADS[0], 16), (128, HEADS[1], 32), (64, HEADS[2], 32), (128, HEADS[3], 16)]


def _case(layout, head_dim, heads, block_size, dtype=np.float32, seed=0):
    hq, hkv = heads
    return make_case(
        LAYOUTS[layout], num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype, pad_tokens=3, pad_seqs=2, seed=seed,
    )  # fmt: skip


def _kernel(case, dtype=None, *, layout="mixed", **kw):
    """The kernel on a case; layout "decode" runs the decode-only kernel (decode_only=True)."""
    args = case.args()
    if dtype is not None:
        args = tuple(jnp.asarray(a, dtype) if i < 3 else a for i, a in enumerate(args))
    scale = case.q.shape[-1] ** -0.5
    out = ragged_paged_attention(*args, sm_scale=scale, decode_only=layout == "decode", **kw)
    return np.asarray(out, np.float32)


def _lowered_for_cuda(case, dtype=jnp.bfloat16, **kw) -> str:
    args = [jnp.asarray(a, dtype) if i < 3 else a for i, a in enumerate(case.args())]
    f = functools.partial(ragged_paged_attention, sm_scale=case.q.shape[-1] ** -0.5, **kw)
    return lower_for_cuda(f, *args)


def _kernels_in(text: str) -> list[tuple[str, int]]:
    """(name, num_stages) of each Triton kernel a lowered step launches."""
    return [
        (m.group(1), int(m.group(2)))
        for line in text.splitlines() if "__gpu$xla.gpu.triton" in line
        for m in [re.search(r'name = "(\w+)".*?num_stages = (\d+)', line)]
    ]  # fmt: skip


# The Triton kernels each compiled variant launches, in order.
_KERNELS = {
    "decode": ["ragged_paged_attention_decode"],
    "mixed": ["ragged_paged_attention_decode", "ragged_paged_attention_mixed"],
}


def _check_fp32(case, out):
    np.testing.assert_allclose(out, naive_attention(case, case.q.shape[-1] ** -0.5), atol=1e-5)
    assert not out[-3:].any()  # padding rows are zero


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize(("head_dim", "heads", "block_size"), INTERPRET_SWEEP)
def test_interpret_matches_oracle_fp32(layout, head_dim, heads, block_size):
    case = _case(layout, head_dim, heads, block_size, seed=head_dim + sum(heads) + block_size)
    _check_fp32(case, _kernel(case, layout=layout, interpret=True))


@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_interpret_matches_oracle_fp32_head_dim_256(layout):
    """fp32 at head_dim 256 runs with fewer KV tokens per step than the default (32 for the
    decode kernel, 32 for the mixed one: shared memory), still the oracle's result."""
    case = _case(layout, 256, (8, 2), 16, seed=7)
    _check_fp32(case, _kernel(case, layout=layout, interpret=True))


@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_head_dim_512_interprets_to_the_oracle_and_lowers_for_cuda(layout):
    """Gemma 4's full-attention layers (head_dim 512): fewer KV tokens a step still fit
    shared memory; the fp32 result is the oracle's, and the bf16 step lowers for CUDA with
    its kernels."""
    case = _case(layout, 512, (8, 2), 16, seed=9)
    _check_fp32(case, _kernel(case, layout=layout, interpret=True))
    kernels = [
        name for name, _ in _kernels_in(_lowered_for_cuda(case, decode_only=layout == "decode"))
    ]
    assert kernels == _KERNELS[layout]


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("heads", [(8, 2), (3, 1)])
def test_interpret_matches_reference_bf16(layout, heads):
    case = _case(layout, 128, heads, 16, dtype=ml_dtypes.bfloat16, seed=5)
    out = _kernel(case, jnp.bfloat16, layout=layout, interpret=True)
    args = tuple(jnp.asarray(a, jnp.bfloat16) if i < 3 else a for i, a in enumerate(case.args()))
    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=128**-0.5), np.float32)
    np.testing.assert_allclose(out, ref, atol=2e-2)
    np.testing.assert_allclose(out, naive_attention(case, 128**-0.5), atol=2e-2)


@pytest.mark.parametrize(
    "tuning",
    [
        dict(num_kv_splits=1, decode_pages_per_step=1),
        dict(num_kv_splits=3, decode_pages_per_step=4),
        dict(num_kv_splits=16, decode_pages_per_step=2),  # most splits empty
        dict(q_block=16, prefill_kv_tokens_per_step=16),
        dict(q_block=128, prefill_kv_tokens_per_step=128),
        dict(mixed_kv_splits=1),
        dict(mixed_kv_splits=3, prefill_kv_tokens_per_step=16),  # some splits empty
    ],
)
def test_tuning_arguments_do_not_change_the_result(tuning):
    for layout in ("mixed", "decode"):
        case = _case(layout, 64, (8, 2), 16, seed=11)
        _check_fp32(case, _kernel(case, layout=layout, interpret=True, **tuning))


def test_decode_batches_run_through_either_variant():
    """A decode batch gives the oracle's result through the decode-only call and through the
    general one; the decode-only call holds the decode kernel alone, the general one the
    decode kernel (its single-token sequences) and the mixed one (the others)."""
    case = _case("decode", 64, (8, 2), 16, seed=2)
    want = naive_attention(case, 0.125)
    for layout in ("decode", "mixed"):
        out = _kernel(case, layout=layout, interpret=True)
        np.testing.assert_allclose(out, want, atol=1e-5)
        assert not out[-3:].any()
        names = [n for n, _ in _kernels_in(_lowered_for_cuda(case, decode_only=layout == "decode"))]
        assert names == _KERNELS[layout]


def _kernel_outputs(num_seqs: int, max_blocks: int, num_tokens=None, **kw) -> dict:
    """Output avals of each pallas_call, by kernel name, for a bf16 batch of num_seqs
    sequences of up to max_blocks 16-token blocks (Hq 32, Hkv 8, D 128) and num_tokens query
    tokens (default: one per sequence, decode-only)."""
    spec, i32 = jax.ShapeDtypeStruct, jnp.int32
    cache = spec((num_seqs * max_blocks + 1, 16, 8, 128), jnp.bfloat16)
    args = (
        spec((num_tokens or num_seqs, 32, 128), jnp.bfloat16), cache, cache,
        spec((num_seqs,), i32), spec((num_seqs, max_blocks), i32), spec((num_seqs + 1,), i32),
        spec((1,), i32),
    )  # fmt: skip
    f = functools.partial(
        ragged_paged_attention, sm_scale=0.1, decode_only=num_tokens is None, **kw
    )
    jaxpr = jax.make_jaxpr(f)(*args)
    calls = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    return {e.params["name"]: [v.aval for v in e.outvars] for e in calls}


def _decode_outputs(num_seqs: int, max_blocks: int, **kw) -> list:
    outputs = _kernel_outputs(num_seqs, max_blocks, **kw)
    assert list(outputs) == ["ragged_paged_attention_decode"]
    return outputs["ragged_paged_attention_decode"]


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_unsplit_decode_writes_its_output_and_split_decode_its_partials():
    """Batch 256 (one split): the kernel writes the bf16 output rows itself, no float32
    partials to merge; batch 1 (33 splits at context 8192, 16 at 2048: one 128-token step
    each): per-split float32 output, max and sum."""
    (out,) = _decode_outputs(256, 128, num_sms=132)
    assert (out.shape, out.dtype) == ((256, 8, 16, 128), jnp.bfloat16)
    for max_blocks, splits in ((512, 33), (128, 16)):
        o, m, l = _decode_outputs(1, max_blocks, num_sms=132)
        assert (o.shape, o.dtype) == ((splits, 1, 8, 16, 128), jnp.float32)
        assert m.shape == l.shape == (splits, 1, 8, 16)


@pytest.mark.cuda_lowering
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("layout", ["decode", "mixed"])
def test_unsplit_and_split_kernels_lower_to_triton_for_cuda(layout, splits):
    case = _case(layout, 128, (8, 2), 16)
    text = _lowered_for_cuda(
        case, decode_only=layout == "decode", num_kv_splits=splits, mixed_kv_splits=splits
    )
    assert [n for n, _ in _kernels_in(text)] == _KERNELS[layout]


def test_mixed_kernel_splits_few_tiles_over_long_contexts():
    """Four query tokens (a speculative verification at batch 1) over up to 8192 keys: one
    64-row tile per KV head, so the tile's keys are split (33 programs per tile and head,
    float32 partials); 1024 tokens fill the SMs with tiles alone (the output, in bf16)."""
    outputs = _kernel_outputs(1, 512, num_tokens=4, num_sms=132)
    o, m, l = outputs["ragged_paged_attention_mixed"]
    assert (o.shape, o.dtype) == ((33, 8, 16 + 64, 128), jnp.float32)
    assert m.shape == l.shape == (33, 8, 16 + 64)
    outputs = _kernel_outputs(4, 512, num_tokens=1024, num_sms=132)
    (out,) = outputs["ragged_paged_attention_mixed"]
    assert (out.shape, out.dtype) == ((8, 4096 + 64, 128), jnp.bfloat16)


def test_rejects_shapes_the_kernel_cannot_tile():
    case = make_case([(1, 4)], num_q_heads=4, num_kv_heads=2, head_dim=48, block_size=16)
    with pytest.raises(ValueError, match="head_dim=48"):
        _kernel(case, interpret=True)
    case = make_case([(1, 4)], num_q_heads=3, num_kv_heads=2, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="Hq=3"):
        _kernel(case, interpret=True)


def test_the_kernel_refuses_an_explicit_tiling_that_does_not_fit():
    """fp32 head_dim 128 with 128 KV tokens per step in 2 stages, given explicitly, is over
    Hopper's shared memory: the kernel refuses it (test_tiling.py checks the plan)."""
    case = _case("decode", 128, (8, 2), 16)
    with pytest.raises(ValueError, match="float32, head_dim 128"):
        _kernel(case, layout="decode", decode_pages_per_step=8, num_stages=2, interpret=True)


def test_the_kernel_refuses_shapes_no_tiling_fits():
    """fp32 head_dim 256 in 256-token pages: one page of K and V alone is over the limit, in
    either variant (test_tiling.py checks the plan's message)."""
    spec = jax.ShapeDtypeStruct
    i32 = jnp.int32
    args = (
        spec((4, 8, 256), jnp.float32), spec((8, 256, 2, 256), jnp.float32),
        spec((8, 256, 2, 256), jnp.float32), spec((4,), i32), spec((4, 2), i32),
        spec((5,), i32), spec((1,), i32),
    )  # fmt: skip
    for decode_only in (True, False):
        f = functools.partial(ragged_paged_attention, sm_scale=0.1, decode_only=decode_only)
        with pytest.raises(ValueError, match="float32, head_dim 256"):
            jax.eval_shape(f, *args)


@pytest.mark.cuda_lowering
@pytest.mark.parametrize(("head_dim", "heads", "block_size"), SWEEP)
def test_lowers_to_triton_for_cuda(head_dim, heads, block_size):
    """Without a GPU: each kernel passes Pallas' Triton lowering (power-of-two tensors, ops),
    one kernel per compiled call."""
    case = _case("mixed", head_dim, heads, block_size)
    for layout in ("decode", "mixed"):
        text = _lowered_for_cuda(case, decode_only=layout == "decode")
        assert [n for n, _ in _kernels_in(text)] == _KERNELS[layout]


@pytest.mark.cuda_lowering
@pytest.mark.parametrize("layout", ["decode", "mixed"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_variant_lowers_to_triton_for_cuda_within_shared_memory(layout, dtype, head_dim):
    """Every kernel variant the runner compiles lowers for CUDA with the stages its tiling
    plans chose, and those plans fit the H100's shared memory."""
    case = _case(layout, head_dim, (8, 2), 16)
    plans = {
        kernel: plan_tiles(
            kernel, dtype=dtype, head_dim=head_dim, block_size=16,
            rows=16 if kernel == "decode" else 64,
        )
        for kernel in ("decode", "mixed")
    }  # fmt: skip
    assert all(p.smem_bytes <= HOPPER_SMEM_BYTES for p in plans.values())
    text = _lowered_for_cuda(case, dtype, decode_only=layout == "decode")
    want = [(name, plans[name.rsplit("_", 1)[1]].num_stages) for name in _KERNELS[layout]]
    assert _kernels_in(text) == want


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize(("head_dim", "heads", "block_size"), SWEEP)
def test_gpu_matches_oracle(layout, head_dim, heads, block_size):
    case = _case(layout, head_dim, heads, block_size, seed=head_dim + sum(heads) + block_size)
    _check_fp32(case, _kernel(case, layout=layout))
    bf16 = _case(layout, head_dim, heads, block_size, dtype=ml_dtypes.bfloat16, seed=3)
    out = _kernel(bf16, jnp.bfloat16, layout=layout)
    np.testing.assert_allclose(out, naive_attention(bf16, head_dim**-0.5), atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_gpu_head_dim_512_matches_oracle(layout):
    """Gemma 4's full layers' head_dim on the GPU: fp32 and bf16 against the oracle."""
    case = _case(layout, 512, (8, 2), 16, seed=9)
    _check_fp32(case, _kernel(case, layout=layout))
    bf16 = _case(layout, 512, (8, 2), 16, dtype=ml_dtypes.bfloat16, seed=4)
    out = _kernel(bf16, jnp.bfloat16, layout=layout)
    np.testing.assert_allclose(out, naive_attention(bf16, 512**-0.5), atol=2e-2)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize(
    ("window", "soft_cap", "tuning"),
    [(1, None, {}), (37, None, dict(num_kv_splits=3, mixed_kv_splits=2)), (20, 1.0, {})],
)  # fmt: skip
def test_sliding_window_and_soft_cap_match_the_oracle(layout, window, soft_cap, tuning):
    """Windows shorter than a block, of a few blocks and not block-aligned (pages before a
    program's window are skipped: the decode splits share only the window's pages); soft caps
    small enough to change every score."""
    case = _case(layout, 64, (8, 2), 16, seed=window or 3)
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    out = _kernel(case, layout=layout, interpret=True, **kw, **tuning)
    np.testing.assert_allclose(out, naive_attention(case, 0.125, window, soft_cap), atol=1e-5)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=0.125, **kw)
    np.testing.assert_allclose(out, np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_sinks_match_the_oracle(layout, splits):
    """gpt-oss's sinks with its window, in the kernels that normalise their own output (one
    split) and in the merge of split partials: as the oracle and the reference."""
    case = _case(layout, 64, (8, 2), 16, seed=17)
    sinks = np.linspace(-2.0, 6.0, 8).astype(np.float32)
    kw = dict(sliding_window=37, sinks=jnp.asarray(sinks))
    out = _kernel(case, layout=layout, interpret=True, num_kv_splits=splits,
                  mixed_kv_splits=splits, **kw)  # fmt: skip
    np.testing.assert_allclose(out, naive_attention(case, 0.125, 37, sinks=sinks), atol=1e-5)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=0.125, **kw)
    np.testing.assert_allclose(out, np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_chunks_match_the_oracle(layout, splits):
    """Llama 4's chunked attention (chunks not block-aligned, pages before a program's chunk
    skipped), unsplit and split: as the oracle and the reference."""
    case = _case(layout, 64, (8, 2), 16, seed=19)
    out = _kernel(case, layout=layout, interpret=True, num_kv_splits=splits,
                  mixed_kv_splits=splits, attention_chunk=40)  # fmt: skip
    np.testing.assert_allclose(out, naive_attention(case, 0.125, chunk=40), atol=1e-5)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=0.125, attention_chunk=40)
    np.testing.assert_allclose(out, np.asarray(ref), atol=1e-5)


@pytest.mark.cuda_lowering
def test_window_and_soft_cap_lower_to_triton_for_cuda():
    case = _case("mixed", 64, (8, 2), 16)
    for decode_only in (True, False):
        text = _lowered_for_cuda(case, sliding_window=20, soft_cap=50.0, decode_only=decode_only)
        assert [n for n, _ in _kernels_in(text)] == _KERNELS["decode" if decode_only else "mixed"]


@pytest.mark.cuda_lowering
@pytest.mark.parametrize("splits", [1, 4])
def test_attention_sinks_and_chunks_lower_to_triton_for_cuda(splits):
    case = _case("mixed", 64, (8, 2), 16)
    sinks = jnp.zeros((8,), jnp.bfloat16)
    for decode_only in (True, False):
        text = _lowered_for_cuda(case, sinks=sinks, sliding_window=128, decode_only=decode_only,
                                 num_kv_splits=splits, mixed_kv_splits=splits)  # fmt: skip
        assert [n for n, _ in _kernels_in(text)] == _KERNELS["decode" if decode_only else "mixed"]
        text = _lowered_for_cuda(case, attention_chunk=8192, decode_only=decode_only,
                                 num_kv_splits=splits, mixed_kv_splits=splits)  # fmt: skip
        assert [n for n, _ in _kernels_in(text)] == _KERNELS["decode" if decode_only else "mixed"]


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
    np.testing.assert_allclose(_kernel(case, layout=layout, interpret=True), want, atol=1e-5)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(ref), want, atol=1e-5)


@pytest.mark.cuda_lowering
def test_fp8_cache_lowers_to_triton_for_cuda():
    case = _fp8_case("mixed")
    args = [jnp.asarray(a) for a in case.args()]
    args[0] = args[0].astype(jnp.bfloat16)
    for decode_only in (True, False):
        f = functools.partial(ragged_paged_attention, sm_scale=0.125, decode_only=decode_only)
        text = lower_for_cuda(f, *args)
        assert [n for n, _ in _kernels_in(text)] == _KERNELS["decode" if decode_only else "mixed"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_gpu_fp8_cache_matches_the_oracle(layout):
    case = _fp8_case(layout)
    np.testing.assert_allclose(
        _kernel(case, layout=layout), naive_attention(case, 0.125), atol=1e-4
    )
