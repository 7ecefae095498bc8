"""The Pallas kernels' multi-head latent attention (DeepSeek's MLA, absorbed form): each cache
token is one head of [latent; rotary key], the keys, whose latent is also the value. Against
the dense oracle with V = the latent columns of K, interpreted on CPU, and lowered for CUDA
at DeepSeek-V3's widths (latent 512 + rotary 64, 16 or 128 query heads a rank)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import ragged_paged_attention_reference
from pallas_kernels.paged_attention.kernel import ragged_paged_attention
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.paged_cases import make_case, naive_attention
from tests.pallas_kernels.test_kernel import LAYOUTS, _kernels_in

LATENT, ROPE = 64, 16


def _mla_case(layout, *, heads=(40, 2), latent=LATENT, rope=ROPE, dtype=np.float32, seed=3):
    """A case whose V cache is K's latent columns (what MLA's attention reads as values)."""
    hq, hkv = heads
    case = make_case(
        LAYOUTS[layout], num_q_heads=hq, num_kv_heads=hkv, head_dim=latent + rope,
        block_size=16, dtype=dtype, pad_tokens=3, pad_seqs=2, seed=seed,
    )  # fmt: skip
    case.v_cache = np.concatenate(
        [case.k_cache[..., :latent], np.zeros_like(case.k_cache[..., latent:])], axis=-1
    )
    return case


def _mla(case, *, latent=LATENT, layout="mixed", **kw):
    q, k, _, *rest = case.args()
    out = ragged_paged_attention(
        q, k, k, *rest, sm_scale=0.1, decode_only=layout == "decode", latent_dim=latent, **kw
    )
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("splits", [1, 3])
def test_mla_matches_the_oracle(layout, splits):
    """40 query heads over 2 latent replicas: 20 a replica in two blocks of 10 (padded to
    16 rows), unsplit and split contexts; the output is the latent-wide attention."""
    case = _mla_case(layout)
    out = _mla(case, layout=layout, interpret=True, num_kv_splits=splits, mixed_kv_splits=splits)
    assert out.shape == (case.q.shape[0], 40, LATENT)
    expected = naive_attention(case, 0.1)[..., :LATENT]
    np.testing.assert_allclose(out, expected, atol=1e-5)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=0.1)
    np.testing.assert_allclose(out, np.asarray(ref)[..., :LATENT], atol=1e-5)
    assert not out[-3:].any()  # padding rows are zero


def test_mla_bf16_matches_the_reference():
    case = _mla_case("mixed", heads=(4, 1), seed=5)
    q, k, _, *rest = (jnp.asarray(a, jnp.bfloat16) if i < 3 else a
                      for i, a in enumerate(case.args()))  # fmt: skip
    out = ragged_paged_attention(q, k, k, *rest, sm_scale=0.1, latent_dim=LATENT, interpret=True)
    ref = ragged_paged_attention_reference(q, k, k, *rest, sm_scale=0.1)[..., :LATENT]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=3e-2)  # fmt: skip


def test_mla_refuses_widths_it_cannot_tile():
    for latent, rope, match in (
        (48, 16, "kv_lora_rank=48"),
        (64, 24, "multiple of"),
        (64, 8, "at least 16"),
    ):
        case = _mla_case("decode", heads=(4, 1), latent=latent, rope=rope)
        with pytest.raises(ValueError, match=match):
            _mla(case, latent=latent, interpret=True)
    case = _mla_case("decode", heads=(4, 1))
    with pytest.raises(ValueError, match="no sinks, sliding window"):
        _mla(case, interpret=True, sliding_window=8)


@pytest.mark.cuda_lowering
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("splits", [1, 4])
def test_mla_lowers_to_triton_for_cuda_at_deepseek_v3_widths(heads, dtype, splits):
    """Latent 512 + rotary 64 (DeepSeek-V3, Kimi K2): both kernels pass the Triton lowering
    within Hopper's shared memory, for a tp-8 rank's 16 heads and tp 1's 128."""
    case = make_case([(1, 40), (9, 70)], num_q_heads=heads, num_kv_heads=1, head_dim=576,
                     block_size=16, pad_tokens=2)  # fmt: skip
    q, k = jnp.asarray(case.q, dtype), jnp.asarray(case.k_cache, dtype)
    rest = case.args()[3:]
    for decode_only in (True, False):
        f = functools.partial(
            ragged_paged_attention, sm_scale=0.1, latent_dim=512, decode_only=decode_only,
            num_kv_splits=splits, mixed_kv_splits=splits,
        )  # fmt: skip
        text = lower_for_cuda(f, q, k, k, *rest)
        names = [n for n, _ in _kernels_in(text)]
        want = ["ragged_paged_attention_decode"]
        assert names == (want if decode_only else [*want, "ragged_paged_attention_mixed"])
