"""Sparse MLA over per-query token lists (`pallas_kernels/sparse_mla`).

- The jnp reference: over a list of a query's whole causal context it is dense MLA (the
  paged-attention reference's `latent_dim` path); over a subset, the float64 oracle of
  attention restricted to those tokens. (The engine's DeepSeek-V3.2 / GLM-5 runs compare it
  with transformers: tests/models/test_deepseek_v32.py.)
- The Mosaic GPU kernel at DeepSeek-V3.2's widths (512 latent + 64 rotary), run by Mosaic
  GPU's interpreter on CPU against the reference (bf16 tolerance), its barriers checked by the
  interpreter's race detector; lowered for CUDA at the real shapes (`cuda_lowering`); on a
  Hopper GPU (`gpu`).
- The indexer's Mosaic GPU kernel (`indexer.py`: the scores page by page) against the jnp
  scores, interpreted (race-checked) and lowered at DeepSeek-V3.2's shapes; its top-k
  through the layer equal to the reference's.
- The layer's dispatch: the kernel under a tp mesh (shard_map over heads and the cache's
  replicas) equals the reference; it is refused, with the reason, where it cannot serve.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.paged_attention import ragged_paged_attention_reference
from pallas_kernels.sparse_mla.reference import index_logits_reference, sparse_mla_reference
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.paged_cases import make_case

mosaic = pytest.importorskip("pallas_kernels.sparse_mla.mosaic", exc_type=ImportError)
indexer = pytest.importorskip("pallas_kernels.sparse_mla.indexer", exc_type=ImportError)

BF16 = ml_dtypes.bfloat16
R, ROPE = 512, 64  # DeepSeek-V3.2's kv_lora_rank and rotary dims
D = R + ROPE


def _context_slots(case, max_len=None) -> np.ndarray:
    """Every query's causal context as cache slots (block * bs + offset), -1 padded."""
    bs = case.k_cache.shape[1]
    rows = []
    for s in range(int(case.num_seqs[0])):
        lo, hi = case.query_start_loc[s], case.query_start_loc[s + 1]
        kv = case.kv_lens[s]
        for i in range(hi - lo):
            idx = np.arange(kv - (hi - lo) + i + 1)
            rows.append(case.block_tables[s, idx // bs] * bs + idx % bs)
    width = max_len or max(len(r) for r in rows)
    out = np.full((case.q.shape[0], width), -1, np.int32)
    for t, r in enumerate(rows):
        out[t, : len(r)] = r
    return out


def _oracle(q, cache, slots, scale) -> np.ndarray:
    """float64 attention of each query over its listed cache rows (zeros for none)."""
    rows = np.asarray(cache, np.float64).reshape(-1, cache.shape[2], cache.shape[3])[:, 0]
    q = np.asarray(q, np.float64)
    out = np.zeros((*q.shape[:2], R))
    for t in range(q.shape[0]):
        keep = slots[t][slots[t] >= 0]
        if keep.size:
            s = q[t] @ rows[keep].T * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[t] = (p / p.sum(-1, keepdims=True)) @ rows[keep, :R]
    return out


def test_reference_over_the_whole_context_is_dense_mla():
    case = make_case([(1, 40), (5, 37), (3, 3)], num_q_heads=4, num_kv_heads=1, head_dim=D,
                     block_size=16, pad_tokens=2, pad_seqs=1, seed=1)  # fmt: skip
    scale = 0.05
    slots = _context_slots(case)
    got = sparse_mla_reference(case.q, case.k_cache, slots, sm_scale=scale, latent_dim=R)
    args = list(case.args())
    args[2] = args[1]  # MLA: the values are the keys' latent columns
    dense = ragged_paged_attention_reference(*args, sm_scale=scale)
    real = int(case.query_start_loc[-1])
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(dense)[:real, :, :R],
                               atol=1e-5)  # fmt: skip
    assert not np.asarray(got)[real:].any()  # a row without tokens gives zeros


def _sparse_case(lens, heads, seed=0, width=None):
    """Random bf16 queries and cache; each token lists `lens[t]` distinct slots."""
    rng = np.random.default_rng(seed)
    blocks, bs = 40, 16
    cache = (rng.standard_normal((blocks, bs, 2, D)) * 0.5).astype(BF16)
    cache[:, :, 1] = cache[:, :, 0]  # two replicas, as tp keeps them
    q = (rng.standard_normal((len(lens), heads, D)) * 0.1).astype(BF16)
    slots = np.full((len(lens), width or max(lens)), -1, np.int32)
    for t, n in enumerate(lens):
        slots[t, :n] = rng.choice(blocks * bs, n, replace=False)
    return q, cache, slots


def _check(q, cache, slots, scale=0.06, **kw):
    out = mosaic.sparse_mla(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(slots),
                            sm_scale=scale, latent_dim=R, **kw)  # fmt: skip
    out = np.asarray(out)
    ref = sparse_mla_reference(q, cache, slots, sm_scale=scale, latent_dim=R)
    np.testing.assert_allclose(out, np.asarray(ref), atol=2e-2)
    np.testing.assert_allclose(out, _oracle(q, cache, slots, scale), atol=2e-2)
    return out


@pytest.mark.parametrize("splits", [1, 3])
def test_interpret_matches_reference(splits):
    """Lists of 0, 1, 63, 64, 65 and 200 tokens (a partial step, exact steps, several, an
    empty one), 20 heads padded to a 64-row tile, both value halves; unsplit or each list
    over 3 programs (some splits empty), 5 persistent programs."""
    q, cache, slots = _sparse_case([0, 1, 63, 64, 65, 200], heads=20, seed=splits, width=256)
    out = _check(q, cache, slots, num_splits=splits, num_sms=5, interpret=True)
    assert not out[0].any()


def test_interpret_two_head_tiles_and_no_races():
    """128 heads (DeepSeek-V3.2 at tp 1: two 64-row tiles) with split lists; the race
    detector finds no read of a buffer before its copy landed, no copy over a buffer still
    read (the staging buffer's refill, the output's reuse of the loop's bytes)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    from pallas_kernels.paged_attention.mosaic import interpret_params

    q, cache, slots = _sparse_case([130, 7], heads=128, seed=4)
    params = interpret_params(detect_races=True)
    _check(q, cache, slots, num_splits=2, num_sms=3, interpret=params)
    assert gpu_callbacks.get_races().races_found is False


def test_refuses_what_it_does_not_take():
    q, cache, slots = _sparse_case([3], heads=4)
    kw = dict(sm_scale=0.1, latent_dim=R)
    with pytest.raises(NotImplementedError, match="sparse_mla_reference"):
        mosaic.sparse_mla(jnp.asarray(q, jnp.float32), jnp.asarray(cache, jnp.float32), slots, **kw)
    with pytest.raises(ValueError, match="latent_dim=256"):
        mosaic.sparse_mla(jnp.asarray(q), jnp.asarray(cache), slots, sm_scale=0.1, latent_dim=256)


# ---------------------------------------------------------------- lowering for CUDA (no GPU)


def _mosaic_results(f, *args) -> list[str]:
    """Lower f(*args) for CUDA: the result types of its Mosaic GPU custom calls, in order."""
    text = lower_for_cuda(f, *args)
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    return [line.rsplit(" -> ", 1)[1] for line in calls]


def _lowered(tokens: int, heads: int, **kw) -> list[str]:
    """The sparse kernel lowered at DeepSeek-V3.2's shapes (top-k 2048, 64-token pages)."""
    spec = jax.ShapeDtypeStruct
    args = (spec((tokens, heads, D), jnp.bfloat16), spec((4097, 64, 1, D), jnp.bfloat16),
            spec((tokens, 2048), jnp.int32))  # fmt: skip
    f = functools.partial(mosaic.sparse_mla, sm_scale=D**-0.5, latent_dim=R, num_sms=132, **kw)
    return _mosaic_results(f, *args)


@pytest.mark.cuda_lowering
@pytest.mark.parametrize(
    ("tokens", "heads", "results"),
    [
        # batch-1 decode at tp 1: 2 head tiles x 2 halves, 32 steps split 32 ways
        (1, 128, "(tensor<32x1x2x2x64x256xf32>, tensor<32x1x2x2x64xf32>, tensor<32x1x2x2x64xf32>)"),
        # 1024 prefill tokens at tp 8 (16 heads a device): 2048 items fill the SMs, unsplit
        (1024, 16, "tensor<1024x1x2x64x256xbf16>"),
    ],
)  # fmt: skip
def test_lowers_for_cuda_at_deepseek_shapes(tokens, heads, results):
    """The compiled path (TMA boxes of [9, 64] per token, the re-layout's loads in the
    smem-copy layout, P from registers) passes Mosaic GPU's lowering, layout inference and
    shared-memory check (not the PTX compile; the GPU suite also lowers it with jax 0.11)."""
    assert _lowered(tokens, heads) == [results]


def test_smem_estimate_fits_hopper():
    from pallas_kernels.paged_attention.mosaic_tiling import HOPPER_SMEM_BYTES

    for split in (False, True):
        need = mosaic.smem_bytes(D, 2, split)
        assert need <= HOPPER_SMEM_BYTES
        assert need == 3 * 64 * D * 2 + 16  # 216 KiB: q, staging, operand; 2 barriers


# ---------------------------------------------------------------- the indexer's kernel


def _index_case(heads=64, block_size=16, seed=0):
    """3 queries over block tables of 11 pages (shuffled; 2.75 steps of 4 pages of 16), at
    positions 0, mid-page and the last; queries rounded to bf16 (the kernel's wgmma input)
    so the scores compare tightly."""
    rng = np.random.default_rng(seed)
    blocks, q = 40, 3
    cache = rng.standard_normal((blocks, block_size, 2, 128)).astype(BF16)
    tables = rng.permutation(blocks)[: q * 11].reshape(q, 11).astype(np.int32)
    iq = (rng.standard_normal((q, heads, 128)) * 0.1).astype(BF16).astype(np.float32)
    iw = rng.standard_normal((q, heads)).astype(np.float32)
    positions = np.array([0, 5 * block_size + 3, 11 * block_size - 1], np.int32)
    return tuple(map(jnp.asarray, (iq, iw, cache, tables, positions)))


def _check_index(case, **kw):
    got = np.asarray(indexer.index_logits(*case, **kw))
    want = np.asarray(index_logits_reference(*case))
    assert (np.isfinite(got) == np.isfinite(want)).all()  # -inf past each position
    seen = np.isfinite(want)
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(("heads", "block_size", "splits"), [(64, 16, 1), (64, 16, 2), (32, 64, 3)])
def test_indexer_interpret_matches_reference(heads, block_size, splits):
    """4 pages of 16 a step, or one of 64; DeepSeek-V3.2's 64 index heads, or 32 padded
    with zero weights; each query's pages split over 1 to 3 programs (some empty)."""
    case = _index_case(heads, block_size, seed=splits)
    _check_index(case, num_splits=splits, num_sms=4, num_stages=2, interpret=True)


def test_indexer_interpret_has_no_races():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    from pallas_kernels.paged_attention.mosaic import interpret_params

    params = interpret_params(detect_races=True)
    _check_index(_index_case(seed=7), num_splits=1, num_sms=2, num_stages=2, interpret=params)
    assert gpu_callbacks.get_races().races_found is False


@pytest.mark.cuda_lowering
@pytest.mark.parametrize("block_size", [64, 16])
def test_indexer_lowers_for_cuda_at_deepseek_shapes(block_size):
    """16 queries (a score tile) over 128k-token block tables, 64 heads of 128."""
    spec = jax.ShapeDtypeStruct
    blocks = 131072 // block_size
    args = (spec((16, 64, 128), jnp.float32), spec((16, 64), jnp.float32),
            spec((4097, block_size, 1, 128), jnp.bfloat16), spec((16, blocks), jnp.int32),
            spec((16,), jnp.int32))  # fmt: skip
    f = functools.partial(indexer.index_logits, num_sms=132)
    assert _mosaic_results(f, *args) == ["tensor<16x131072xf32>"]


def test_layer_index_topk_with_the_kernel_equals_the_reference(monkeypatch):
    """index_topk through the (interpreted) kernel picks the reference's tokens."""
    from jaxserve.layers import sparse_mla as layer

    case = make_case([(1, 90), (3, 40)], num_q_heads=1, num_kv_heads=1, head_dim=128,
                     block_size=16, dtype=BF16, pad_tokens=1, pad_seqs=1, seed=5)  # fmt: skip
    md = _metadata(case)
    rng = np.random.default_rng(1)
    t = case.q.shape[0]
    iq = jnp.asarray((rng.standard_normal((t, 64, 128)) * 0.1).astype(BF16), jnp.float32)
    iw = jnp.asarray(rng.standard_normal((t, 64)), jnp.float32)
    positions = jnp.asarray([89, 37, 38, 39, 0], jnp.int32)
    cache = jnp.asarray(case.v_cache)
    want = layer.index_topk(iq, iw, positions, cache, md, 8)
    interpreted = functools.partial(indexer.index_logits, interpret=True, num_sms=4)
    monkeypatch.setattr(layer, "_mosaic", lambda *a: interpreted)
    got = layer.index_topk(iq, iw, positions, cache, md, 8, backend="pallas")
    np.testing.assert_array_equal(np.asarray(got)[:4], np.asarray(want)[:4])
    assert (np.asarray(want)[:4] >= 0).all()


# ---------------------------------------------------------------- the layer's dispatch


def _metadata(case):
    from jaxserve.layers.attention import AttentionMetadata

    t = case.q.shape[0]
    return AttentionMetadata(
        slot_mapping=jnp.zeros((1, t), jnp.int32),
        block_tables=jnp.asarray(case.block_tables),
        kv_lens=jnp.asarray(case.kv_lens),
        query_start_loc=jnp.asarray(case.query_start_loc),
        num_seqs=jnp.asarray(case.num_seqs),
    )


def test_layer_runs_the_kernel_per_device_under_tp(monkeypatch):
    """sparse_mla_attention with a kernel on a tp-2 mesh: each device gets its 8 heads, its
    replica of the cache and every query's slots (a shard_map: a custom call cannot be
    auto-partitioned), and the result equals the reference's. The kernel here is the
    reference itself, per device (Mosaic GPU's interpreter hangs at times under a
    multi-device shard_map; the kernel equals the reference above)."""
    from jaxserve.distributed.mesh import make_mesh
    from jaxserve.layers import sparse_mla as layer

    case = make_case([(1, 90), (4, 30)], num_q_heads=16, num_kv_heads=2, head_dim=D,
                     block_size=16, pad_tokens=1, pad_seqs=1, seed=3)  # fmt: skip
    case.k_cache[:, :, 1] = case.k_cache[:, :, 0]
    chosen = np.full((case.q.shape[0], 64), -1, np.int32)
    chosen[0, :50] = np.random.default_rng(0).choice(90, 50, replace=False)
    chosen[1:5, :20] = np.arange(20)
    seen = []

    def per_device(q, cache, slots, **kw):
        seen.append((q.shape, cache.shape, slots.shape))
        return sparse_mla_reference(q, cache, slots, **kw)

    monkeypatch.setattr(layer, "_kernel", lambda *a: per_device)
    md = _metadata(case)
    kw = dict(sm_scale=0.06, latent_dim=R)
    q, cache = jnp.asarray(case.q), jnp.asarray(case.k_cache)
    got = layer.sparse_mla_attention(q, chosen, cache, md, mesh=make_mesh(2), **kw)
    t, blocks = case.q.shape[0], case.k_cache.shape[0]
    assert seen == [((t, 8, D), (blocks, 16, 1, D), (t, 64))]
    monkeypatch.undo()
    want = layer.sparse_mla_attention(q, chosen, cache, md, **kw)  # the reference, whole
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert np.abs(np.asarray(want)).max() > 0.1


def test_layer_scores_per_device_under_tp(monkeypatch):
    """The indexer kernel under a tp-2 mesh gets every query and its device's replica of
    the index-key cache (the reference stands in for it per device, as above)."""
    from jaxserve.distributed.mesh import make_mesh
    from jaxserve.layers import sparse_mla as layer

    iq, iw, cache, tables, positions = _index_case(seed=2)
    seen = []

    def per_device(*args):
        seen.append(tuple(a.shape for a in args))
        return index_logits_reference(*args)

    monkeypatch.setattr(layer, "_mosaic", lambda *a: per_device)
    scores = layer._index_scores("pallas", iq, cache, make_mesh(2))
    got = jax.jit(scores)(iq, iw, cache, tables, positions)
    assert seen == [(iq.shape, iw.shape, (40, 16, 1, 128), tables.shape, positions.shape)]
    want = index_logits_reference(iq, iw, cache, tables, positions)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_layer_refuses_the_kernel_where_it_cannot_serve(monkeypatch, caplog):
    from jaxserve.layers import sparse_mla as layer

    monkeypatch.setenv("JAXSERVE_SPARSE_MLA_KERNEL", "mosaic")
    q = jnp.zeros((2, 4, D), jnp.bfloat16)
    with caplog.at_level(logging.WARNING):
        assert layer._kernel("pallas", q, q, R, None) is None  # CPU
    assert "cpu device" in caplog.text
    gpu = type("Dev", (), {"platform": "gpu", "compute_capability": "8.0"})()
    assert "sm_90" in layer.mosaic_refusal(
        q_dtype=q.dtype, cache_dtype=q.dtype, head_dim=D, latent_dim=R, device=gpu
    )
    gpu.compute_capability = "9.0"
    refuse = functools.partial(layer.mosaic_refusal, head_dim=D, latent_dim=R, device=gpu)
    assert refuse(q_dtype=q.dtype, cache_dtype=q.dtype) is None
    assert "float32" in refuse(q_dtype=jnp.dtype("float32"), cache_dtype=jnp.dtype("float32"))
    monkeypatch.setenv("JAXSERVE_SPARSE_MLA_KERNEL", "triton")
    with pytest.raises(ValueError, match="'triton' is not one of"):
        layer._kernel("pallas", q, q, R, None)


# ---------------------------------------------------------------- real GPU


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gpu_matches_reference(splits):
    device = jax.devices()[0]
    if float(getattr(device, "compute_capability", "0")) < 9.0:
        pytest.skip(f"Mosaic GPU needs sm_90 or newer, this GPU is {device.device_kind}")
    q, cache, slots = _sparse_case([0, 1, 63, 64, 65, 2048, 700], heads=128, seed=5, width=2048)
    _check(q, cache, slots, num_splits=splits)
    for block_size in (16, 64):
        _check_index(_index_case(64, block_size, seed=6), num_splits=splits)


@pytest.mark.cuda_lowering
def test_layer_kernels_lower_for_cuda_in_the_layer(monkeypatch):
    """With JAXSERVE_SPARSE_MLA_KERNEL=mosaic on a (pretended) Hopper device, index_topk (the
    indexer kernel inside its lax.map over 16-query tiles, XLA's top-k after) and
    sparse_mla_attention (block ids -> slots, the attention kernel) lower for CUDA at
    DeepSeek-V3.2's widths: one Mosaic GPU custom call each."""
    from jaxserve.layers import sparse_mla as layer
    from jaxserve.layers.attention import AttentionMetadata

    hopper = type("Dev", (), {"platform": "gpu", "compute_capability": "9.0"})()
    monkeypatch.setattr(layer, "_device", lambda mesh: hopper)
    monkeypatch.setenv("JAXSERVE_SPARSE_MLA_KERNEL", "mosaic")
    spec, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    t, seqs, blocks = 32, 4, 512  # 32 tokens of 4 sequences, 32k-token tables of 64
    md = AttentionMetadata(slot_mapping=spec((1, t), i32), block_tables=spec((seqs, blocks), i32),
                           kv_lens=spec((seqs,), i32), query_start_loc=spec((seqs + 1,), i32),
                           num_seqs=spec((1,), i32))  # fmt: skip

    def step(iq, iw, positions, q, k_cache, v_cache, md):
        chosen = layer.index_topk(iq, iw, positions, v_cache, md, 2048, backend="pallas")
        return layer.sparse_mla_attention(q, chosen, k_cache, md, sm_scale=0.04, latent_dim=R,
                                          backend="pallas")  # fmt: skip

    args = (spec((t, 64, 128), jnp.float32), spec((t, 64), jnp.float32), spec((t,), i32),
            spec((t, 16, D), bf16), spec((2049, 64, 1, D), bf16),
            spec((2049, 64, 1, 128), bf16), md)  # fmt: skip
    indexer_out, attention_out = _mosaic_results(step, *args)
    assert indexer_out == "tensor<16x32768xf32>"  # a 16-query tile's scores
    assert attention_out.startswith("(tensor<")  # 32 tokens' split partials
