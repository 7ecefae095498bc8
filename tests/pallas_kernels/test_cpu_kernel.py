"""The CPU attention backend (decode rows in the C++ kernel, prefill rows as the reference)
against the dense oracle and the jnp reference; its build cache and its fallbacks."""

import functools
import itertools
import logging
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.layers import attention
from pallas_kernels.paged_attention import cpu, ragged_paged_attention_reference
from pallas_kernels.paged_attention.cpu import (
    cpu_kernel_unavailable_message,
    ragged_paged_attention_cpu,
)
from tests.pallas_kernels.paged_cases import make_case, naive_attention
from tests.pallas_kernels.test_reference import DECODE, LONG, MIXED
from tests.require import require_or_skip


@pytest.fixture
def compiler():
    """A machine without a C++ compiler cannot build the kernel: the engine then falls back to
    the reference (tested below); everything else here needs the kernel, and skips (fails
    under JAXSERVE_TEST_REQUIRE_ALL=1, as in CI) without one."""
    require_or_skip(
        None if cpu._compiler() else "no C++ compiler (g++/c++/$CXX) to build the kernel"
    )


needs_compiler = pytest.mark.usefixtures("compiler")

# head_dim 64/128/256 take the kernel's fixed-width code, 32 and 80 its generic one.
SWEEP = list(itertools.product([32, 64, 80, 128, 256], [(1, 1), (3, 1), (9, 3), (8, 2)], [16]))
SWEEP += [(64, (8, 2), 32), (64, (4, 4), 8)]


def _case(layout, head_dim=64, heads=(6, 2), block_size=16, seed=0):
    return make_case(
        layout, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
        block_size=block_size, pad_tokens=3, pad_seqs=2, seed=seed,
    )  # fmt: skip


@needs_compiler
def test_the_kernel_builds_here():
    assert cpu_kernel_unavailable_message() is None
    assert attention.default_attention_backend("cpu") == "cpu"


@needs_compiler
@pytest.mark.parametrize(("head_dim", "heads", "block_size"), SWEEP)
def test_matches_dense_oracle_fp32(head_dim, heads, block_size):
    case = _case(MIXED, head_dim, heads, block_size, seed=head_dim + heads[0] + block_size)
    scale = head_dim**-0.5
    out = np.asarray(ragged_paged_attention_cpu(*case.args(), sm_scale=scale))
    np.testing.assert_allclose(out, naive_attention(case, scale), atol=1e-5, rtol=0)
    assert not out[-3:].any()  # padding rows are zero


@needs_compiler
@pytest.mark.parametrize(
    ("layout", "decode_only"), [(DECODE, False), (DECODE, True), (LONG, False), (MIXED, False)]
)
def test_equals_the_reference(layout, decode_only):
    case = _case(layout, seed=len(layout))
    kw = dict(sm_scale=0.125, decode_only=decode_only)
    out = ragged_paged_attention_cpu(*case.args(), **kw)
    ref = ragged_paged_attention_reference(*case.args(), **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=0)


@needs_compiler
@pytest.mark.parametrize(("window", "soft_cap"), [(1, None), (16, None), (29, 2.0), (None, 1.0)])
@pytest.mark.parametrize("layout", [MIXED, DECODE])
def test_sliding_window_and_soft_cap_match_the_oracle(layout, window, soft_cap):
    case = _case(layout, seed=window or 5)
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    out = np.asarray(ragged_paged_attention_cpu(*case.args(), sm_scale=0.125, **kw))
    np.testing.assert_allclose(out, naive_attention(case, 0.125, window, soft_cap), atol=1e-5)


@needs_compiler
def test_padding_sequences_ignored_and_no_recompile_on_num_seqs():
    case = _case(MIXED)
    full = np.asarray(ragged_paged_attention_cpu(*case.args(), sm_scale=0.125))
    before = ragged_paged_attention_cpu._cache_size()
    case.num_seqs = np.array([4], np.int32)
    part = np.asarray(ragged_paged_attention_cpu(*case.args(), sm_scale=0.125))
    assert ragged_paged_attention_cpu._cache_size() == before
    cut = case.query_start_loc[4]
    np.testing.assert_array_equal(part[:cut], full[:cut])
    assert not part[cut:].any()


@needs_compiler
def test_decode_rows_are_the_kernel_and_read_the_cache_in_place():
    """A decode-only call is the custom call alone: no gather of the cache, no loop."""
    case = _case(DECODE)
    f = jax.jit(functools.partial(ragged_paged_attention_cpu, sm_scale=0.125, decode_only=True))
    text = f.lower(*case.args()).compile().as_text()
    assert "jaxserve_paged_attention_decode" in text
    assert " gather(" not in text and " while(" not in text


@needs_compiler
@pytest.mark.parametrize(
    "layout",
    [[(1, 300 + 7 * i) for i in range(24)],  # threads take whole sequences
     [(1, 6000)]],  # fewer sequences than threads: threads take its KV heads
)  # fmt: skip
def test_threads_split_the_work_without_changing_the_result(layout):
    """Long decodes (enough keys for every thread the machine allows) equal the oracle."""
    case = _case(layout, heads=(9, 3), seed=11)
    out = np.asarray(ragged_paged_attention_cpu(*case.args(), sm_scale=0.125, decode_only=True))
    np.testing.assert_allclose(out, naive_attention(case, 0.125), atol=1e-5, rtol=0)


def test_other_dtypes_take_the_reference():
    """bf16 (and fp8) caches are not the kernel's: the call is the reference, bit for bit."""
    case = make_case(
        MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=ml_dtypes.bfloat16, seed=7,
    )  # fmt: skip
    args = tuple(jnp.asarray(a, jnp.bfloat16) if i < 3 else a for i, a in enumerate(case.args()))
    out = ragged_paged_attention_cpu(*args, sm_scale=0.125)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


@needs_compiler
def test_the_library_is_built_once_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    compiler = cpu._compiler()
    lib = cpu._build(compiler)
    assert lib.parent == tmp_path and lib.suffix == ".so"
    built = lib.stat().st_mtime_ns
    assert cpu._build(compiler) == lib and lib.stat().st_mtime_ns == built  # cached
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary left behind


def test_a_missing_compiler_falls_back_to_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    assert "no C++ compiler" in cpu._load.__wrapped__()
    monkeypatch.setattr(cpu, "_load", cpu._load.__wrapped__)
    with caplog.at_level(logging.WARNING):
        assert attention.default_attention_backend("cpu") == "reference"
    assert "no C++ compiler" in caplog.text and "reference" in caplog.text
    assert attention.default_attention_backend("gpu") == "pallas"


def test_a_failing_build_names_the_compiler_error(tmp_path, monkeypatch):
    if shutil.which("false") is None:
        pytest.skip("needs /bin/false")
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "_compiler", lambda: shutil.which("false"))
    assert "building cpu_decode.cc failed" in cpu._load.__wrapped__()
    assert not list(tmp_path.iterdir())


@needs_compiler
def test_causal_extension_reaches_the_multi_token_rows():
    """Gemma 3's causal_ext: the prefill rows (the reference's) take it, the decode rows
    (the kernel's) are as without it."""
    case = _case([(1, 20), (24, 40), (1, 33)], seed=4)
    ext = np.zeros(case.q.shape[0], np.int32)
    ext[1 + 3 : 1 + 15] = np.arange(11, -1, -1)  # sequence 1: an image over its rows 3..14
    out = cpu.ragged_paged_attention_cpu(*case.args(), sm_scale=0.125, causal_ext=ext)
    want = naive_attention(case, 0.125, causal_ext=ext)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=0)
