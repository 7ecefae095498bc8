"""ragged_paged_attention_reference against a dense per-sequence oracle."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.paged_attention import ragged_paged_attention_reference
from tests.pallas_kernels.paged_cases import make_case, naive_attention

# (q_len, kv_len): decodes at kv 1, at an exact block multiple and not; a whole prompt; a
# prefill chunk that starts mid-sequence; a long decode spanning several reference chunks.
MIXED = [(1, 1), (1, 32), (1, 45), (7, 7), (5, 37), (1, 300), (16, 64)]
# Every sequence decoding (the reference's per-row path) and a long prefill chunk (many tiles).
DECODE = [(1, 1), (1, 16), (1, 45), (1, 300), (1, 129)]
LONG = [(1, 20), (100, 300), (33, 33)]

# Every head_dim, GQA group and block size, each pair of head_dim and block size once (the
# reference is one jnp program: the rest of the product is the same code at other shapes).
SWEEP = [(64, (1, 1), 16), (128, (3, 1), 32), (64, (4, 4), 32), (128, (8, 2), 16)]


def _run(case, sm_scale, dtype=None):
    args = case.args()
    if dtype is not None:
        args = tuple(jnp.asarray(a, dtype) if i < 3 else a for i, a in enumerate(args))
    return np.asarray(ragged_paged_attention_reference(*args, sm_scale=sm_scale), np.float32)


@pytest.mark.parametrize(("head_dim", "heads", "block_size"), SWEEP)
def test_matches_dense_oracle_fp32(head_dim, heads, block_size):
    hq, hkv = heads
    case = make_case(
        MIXED, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size,
        pad_tokens=5, pad_seqs=2, seed=head_dim + hq + block_size,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = _run(case, scale)
    np.testing.assert_allclose(out, naive_attention(case, scale), atol=1e-5, rtol=0)
    assert not out[-5:].any()  # padding rows are zero


@pytest.mark.parametrize("layout", [DECODE, LONG])
def test_decode_and_long_prefill_layouts_match_the_oracle(layout):
    case = make_case(
        layout, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, pad_tokens=3,
        pad_seqs=2, seed=len(layout),
    )  # fmt: skip
    out = _run(case, 0.125)
    np.testing.assert_allclose(out, naive_attention(case, 0.125), atol=1e-5, rtol=0)
    assert not out[-3:].any()


def test_decode_only_runs_the_decode_path_alone():
    """decode_only=True (the draft model's proposal steps): the same result on a decode batch,
    with the prefill path left out of the program."""
    case = make_case(
        DECODE, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, pad_tokens=3,
        pad_seqs=2, seed=3,
    )  # fmt: skip
    out = ragged_paged_attention_reference(*case.args(), sm_scale=0.125, decode_only=True)
    np.testing.assert_allclose(np.asarray(out), naive_attention(case, 0.125), atol=1e-5, rtol=0)
    assert not np.asarray(out)[-3:].any()
    f = functools.partial(ragged_paged_attention_reference, sm_scale=0.125)
    loops = [jax.jit(f, static_argnames="decode_only").lower(*case.args(), decode_only=d)
             .as_text().count("stablehlo.while") for d in (True, False)]  # fmt: skip
    assert loops[0] < loops[1]


def test_matches_dense_oracle_bf16():
    case = make_case(
        MIXED, num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
        dtype=ml_dtypes.bfloat16, pad_tokens=3, seed=7,
    )  # fmt: skip
    out = _run(case, 128**-0.5, jnp.bfloat16)
    np.testing.assert_allclose(out, naive_attention(case, 128**-0.5), atol=2e-2, rtol=0)


def test_padding_sequences_ignored_and_no_recompile_on_num_seqs():
    """Changing num_seqs (an array) reuses the compiled function; rows past it are zero."""
    case = make_case(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=3)
    full = _run(case, 0.125)
    before = ragged_paged_attention_reference._cache_size()
    case.num_seqs = np.array([4], np.int32)
    part = _run(case, 0.125)
    assert ragged_paged_attention_reference._cache_size() == before
    cut = case.query_start_loc[4]
    np.testing.assert_array_equal(part[:cut], full[:cut])
    assert not part[cut:].any()


@pytest.mark.parametrize("window", [1, 16, 29, 1000])
@pytest.mark.parametrize("layout", [MIXED, DECODE, LONG])
def test_sliding_window_matches_the_oracle(layout, window):
    case = make_case(
        layout, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, pad_tokens=3,
        pad_seqs=2, seed=window,
    )  # fmt: skip
    args = case.args()
    out = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.125, sliding_window=window))
    np.testing.assert_allclose(out, naive_attention(case, 0.125, window), atol=1e-5, rtol=0)
    assert not out[-3:].any()


@pytest.mark.parametrize("layout", [MIXED, DECODE, LONG])
def test_attention_sinks_match_the_oracle(layout):
    """gpt-oss's sinks (a logit per query head, large enough to take most of the weight on
    some heads) with its window, in both paths (decode rows, prefill tiles)."""
    case = make_case(
        layout, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, pad_tokens=3,
        pad_seqs=2, seed=5,
    )  # fmt: skip
    sinks = np.array([-2.0, 0.0, 0.5, 1.0, 3.0, 8.0], np.float32)
    out = ragged_paged_attention_reference(
        *case.args(), jnp.asarray(sinks), sm_scale=0.125, sliding_window=29
    )
    want = naive_attention(case, 0.125, 29, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=0)
    assert not np.asarray(out)[-3:].any()


@pytest.mark.parametrize("layout", [MIXED, DECODE, LONG])
def test_attention_chunks_match_the_oracle(layout):
    """Llama 4's chunked attention (a query sees its own chunk's keys only), chunks shorter
    than a block and not block-aligned, in both paths."""
    case = make_case(
        layout, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, pad_tokens=3,
        pad_seqs=2, seed=6,
    )  # fmt: skip
    for chunk in (5, 37):
        out = ragged_paged_attention_reference(*case.args(), sm_scale=0.125, attention_chunk=chunk)
        want = naive_attention(case, 0.125, chunk=chunk)
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_causal_extension_matches_the_oracle(window):
    """Gemma 3's bidirectional images: each token of a run ("image") sees the run's later
    keys too (causal_ext = the run's last position - its own), with and without a sliding
    window (which still counts back from the query's own position); decode rows unchanged."""
    layout = [(1, 20), (24, 40), (9, 9)]
    case = make_case(
        layout, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8, pad_tokens=3,
        pad_seqs=1, seed=9,
    )  # fmt: skip
    ext = np.zeros(case.q.shape[0], np.int32)
    ext[1 + 3 : 1 + 15] = np.arange(11, -1, -1)  # sequence 1: an image over its rows 3..14
    ext[25 + 2 : 25 + 6] = np.arange(3, -1, -1)  # sequence 2: rows 2..5
    out = ragged_paged_attention_reference(
        *case.args(), sm_scale=0.2, sliding_window=window, causal_ext=jnp.asarray(ext)
    )
    want = naive_attention(case, 0.2, window, causal_ext=ext)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=0)
    causal = naive_attention(case, 0.2, window)
    assert not np.allclose(want[4:15], causal[4:15])  # the extension changes those rows
