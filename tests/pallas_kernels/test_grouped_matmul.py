"""pallas_kernels/grouped_matmul: each implementation gives jax.lax.ragged_dot's result (the
reference) on the groups a mixture-of-experts step makes: empty groups, groups spanning several
tiles, rows past the groups (zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gmm

SIZES = [[3, 0, 17, 1], [0, 0, 0, 0], [40, 0, 0, 2], [1, 1, 1, 1]]


@pytest.mark.parametrize("sizes", SIZES)
def test_cpu_tiles_equal_ragged_dot(sizes):
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    x = jnp.asarray(rng.normal(size=(48, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)
    groups = jnp.asarray(sizes, jnp.int32)
    assert gmm.choose(x, w) == "tiles"
    got = np.asarray(jax.jit(gmm.grouped_matmul)(x, w, groups))
    np.testing.assert_allclose(got, np.asarray(gmm.reference(x, w, groups)), atol=1e-5)


def test_forced_xla_on_cpu(monkeypatch):
    monkeypatch.setenv("JAXSERVE_MOE_KERNEL", "xla")
    x = jnp.ones((4, 8), jnp.float32)
    assert gmm.choose(x, jnp.ones((2, 8, 4), jnp.float32)) == "xla"


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[0, 4, 0, 0, 0, 0, 0, 0], [1, 0, 30, 2, 0, 0, 60, 3]])
def test_gpu_kernel_equals_ragged_dot(sizes):
    """On the GPU the chosen implementation (tokamax's Mosaic kernel on sm_90 and later when
    installed and JAXSERVE_MOE_KERNEL=tokamax) gives ragged_dot's bf16 result within bf16
    rounding, rows past the groups zero."""
    rng = np.random.default_rng(sum(sizes))
    x = jnp.asarray(rng.normal(size=(128, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(8, 256, 512)) * 0.05, jnp.bfloat16)
    groups = jnp.asarray(sizes, jnp.int32)
    print("grouped matmul implementation:", gmm.choose(x, w))
    got = np.asarray(jax.jit(gmm.grouped_matmul)(x, w, groups), np.float32)
    want = np.asarray(gmm.reference(x, w, groups), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    assert not got[sum(sizes) :].any()


def _packed(mode: str, rng) -> gmm.Packed:
    """A random stack of 4 experts [4, 64, 24] packed as `mode`."""
    e, k, n = 4, 64, 24
    group = {"mxfp4": 32, "int4": 16, "fp8_block": 32}[mode]
    if mode == "fp8_block":
        kernel = jnp.asarray(rng.normal(size=(e, k, n)) * 8, jnp.float8_e4m3fn)
    else:
        kernel = jnp.asarray(rng.integers(0, 256, (e, k // 2, n)), jnp.uint8)
    if mode == "mxfp4":
        scale = jnp.asarray(rng.integers(120, 130, (e, k // group, n)), jnp.uint8)
    else:
        scale = jnp.asarray(rng.uniform(0.01, 0.1, (e, k // group, n)), jnp.float32)
    offset = (
        jnp.asarray(rng.normal(size=(e, k // group, n)), jnp.float32) if mode == "int4" else None
    )
    return gmm.Packed(kernel, scale, offset, group)


@pytest.mark.parametrize("mode", ["mxfp4", "int4", "fp8_block"])
def test_cpu_tiles_decode_packed_experts_one_at_a_time(mode):
    """The tile loop decodes each tile's expert alone, as decoding the whole stack first
    would (empty experts, a group over several tiles, rows past the groups zero)."""
    rng = np.random.default_rng(7)
    w = _packed(mode, rng)
    assert w.shape == (4, 64, 24)
    x = jnp.asarray(rng.normal(size=(40, 64)), jnp.float32)
    groups = jnp.asarray([3, 0, 20, 9], jnp.int32)  # 32 of 40 rows
    got = np.asarray(jax.jit(gmm.grouped_matmul)(x, w, groups))
    want = np.asarray(jax.lax.ragged_dot(x, w.dense(jnp.float32), groups))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not got[32:].any()


@pytest.mark.parametrize("mode", ["mxfp4", "int4", "fp8_block"])
def test_cpu_packed_kernel_decodes_every_code_as_the_reference(mode):
    """The C++ kernel (where a compiler builds it) decodes every byte a format can hold as
    packed.py's jnp decoding does (fp8's NaN codes aside), with multi-expert groups."""
    from pallas_kernels.grouped_matmul import cpu_packed

    if cpu_packed.unavailable_message():
        pytest.skip(cpu_packed.unavailable_message())
    rng = np.random.default_rng(11)
    w = _packed(mode, rng)
    codes = np.arange(256, dtype=np.uint8)
    if mode == "fp8_block":
        codes = codes[(codes & 0x7F) != 0x7F]  # not the NaNs
    k = np.resize(codes, w.kernel.shape)
    w = gmm.Packed(jnp.asarray(k).view(w.kernel.dtype), w.scale, w.offset, w.group)
    x = jnp.asarray(rng.normal(size=(33, 64)), jnp.float32)
    groups = jnp.asarray([1, 0, 29, 2], jnp.int32)  # 32 of 33 rows
    assert cpu_packed.runs(x, w)
    got = np.asarray(jax.jit(cpu_packed.packed_matmul_cpu)(x, w, groups))
    want = np.asarray(jax.lax.ragged_dot(x, w.dense(jnp.float32), groups))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    assert not got[32:].any()
