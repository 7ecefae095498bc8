"""Which Pallas kernel a GPU gets: the measured table's, else Triton; the override; and the
calls the Mosaic kernel cannot serve going to Triton whatever was measured."""

import json
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from jaxserve.layers.attention import _pallas_kernel
from pallas_kernels.paged_attention import ragged_paged_attention
from pallas_kernels.paged_attention.choice import (
    KERNELS,
    TABLE,
    choose_kernel,
    measured_choice,
    mosaic_kernel,
)

H100 = "NVIDIA H100 80GB HBM3"
CALL = dict(q_dtype="bfloat16", cache_dtype="bfloat16", head_dim=128, block_size=16,
            attention_chunk=None, latent_dim=None, compute_capability="9.0")  # fmt: skip


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "kernel_choice.json"
    path.write_text(json.dumps({"devices": {H100: "mosaic", "NVIDIA A100-SXM4-80GB": "triton"}}))
    return path


def test_the_committed_table_names_only_known_kernels():
    devices = json.loads(TABLE.read_text())["devices"]
    assert all(measured_choice(kind) in KERNELS for kind in devices)


def test_a_measured_device_gets_its_kernel_and_a_new_one_gets_triton(table, monkeypatch):
    monkeypatch.delenv("JAXSERVE_PALLAS_KERNEL", raising=False)
    assert choose_kernel(H100, table=table, **CALL) == "mosaic"
    assert choose_kernel("NVIDIA A100-SXM4-80GB", table=table, **CALL) == "triton"
    assert choose_kernel("NVIDIA B200", table=table, **CALL) == "triton"  # not measured yet
    monkeypatch.setenv("JAXSERVE_PALLAS_KERNEL", "mosaic")
    assert choose_kernel("NVIDIA B200", table=table, **CALL) == "mosaic"
    monkeypatch.setenv("JAXSERVE_PALLAS_KERNEL", "triton")
    assert choose_kernel(H100, table=table, **CALL) == "triton"
    monkeypatch.setenv("JAXSERVE_PALLAS_KERNEL", "cuda")
    with pytest.raises(ValueError, match="JAXSERVE_PALLAS_KERNEL='cuda'"):
        choose_kernel(H100, table=table, **CALL)


@pytest.mark.parametrize(
    "change",
    [
        dict(q_dtype="float32", cache_dtype="float32"),
        dict(cache_dtype="float8_e4m3fn"),
        dict(attention_chunk=8192),
        dict(latent_dim=512),
        dict(head_dim=96),
        dict(block_size=12),
        dict(compute_capability="8.0"),
    ],  # fmt: skip
)
def test_what_the_mosaic_kernel_cannot_serve_goes_to_triton(table, change):
    assert choose_kernel(H100, override="mosaic", table=table, **{**CALL, **change}) == "triton"


def test_a_bad_table_entry_is_named(tmp_path):
    path = tmp_path / "kernel_choice.json"
    path.write_text(json.dumps({"devices": {H100: "cutlass"}}))
    with pytest.raises(ValueError, match="'cutlass' is not one of"):
        choose_kernel(H100, override=None, table=path, **CALL)


def test_the_attention_layer_runs_the_chosen_kernel_on_a_gpu(monkeypatch):
    q, cache = jnp.zeros((4, 32, 128), jnp.bfloat16), jnp.zeros((8, 16, 8, 128), jnp.bfloat16)
    gpu = SimpleNamespace(platform="gpu", device_kind=H100, compute_capability="9.0")
    monkeypatch.setenv("JAXSERVE_PALLAS_KERNEL", "mosaic")
    assert mosaic_kernel() is not None  # this jax has Mosaic GPU
    assert _pallas_kernel(gpu, q, cache, None, None) is mosaic_kernel()
    assert _pallas_kernel(gpu, q.astype(jnp.float32), cache, None, None) is ragged_paged_attention
    monkeypatch.setenv("JAXSERVE_PALLAS_KERNEL", "triton")
    assert _pallas_kernel(gpu, q, cache, None, None) is ragged_paged_attention
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu")  # interpreted: Triton's
    monkeypatch.setenv("JAXSERVE_PALLAS_KERNEL", "mosaic")
    assert _pallas_kernel(cpu, q, cache, None, None) is ragged_paged_attention
