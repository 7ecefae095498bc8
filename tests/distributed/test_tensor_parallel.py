"""The same logits for tp = 1, 2 and 4 over CPU devices (conftest forces 4 host devices)."""

import numpy as np
import pytest

from jaxserve.distributed.mesh import make_mesh
from jaxserve.distributed.sharding import validate_tp
from jaxserve.models.loader import load_model
from tests.helpers import hf_logits, hf_model, make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule

FAMILIES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "gemma3": ("gemma3", {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24}),
}


def tiny(tmp_path_factory, name):
    # 8 query heads, 2 KV heads: tp=2 shards the KV heads, tp=4 replicates them.
    family, overrides = FAMILIES[name]
    return make_tiny_hf(family, tmp_path_factory.mktemp(name), num_key_value_heads=2, **overrides)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny(tmp_path_factory, "qwen2")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_identical_across_tp(family, tmp_path_factory, model_dir, cpu_devices):
    if family != "qwen2":
        model_dir = tiny(tmp_path_factory, family)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 14)]
    results = {}
    for tp in (1, 2, 4):
        loaded = load_model(model_dir, dtype="float32", mesh=make_mesh(tp, cpu_devices))
        qkv = loaded.model.layers[0].self_attn.qkv_proj.kernel[...]
        # each device: its 8 / tp query heads and the (one copy of the) KV head they use
        heads_per_device = 8 // tp + 2 * max(1, 2 // tp)
        hd = loaded.config.head_dim
        assert qkv.sharding.shard_shape(qkv.shape)[1] == heads_per_device * hd
        fed, results[tp] = run_mixed_schedule(loaded, prompts)
    for tp in (2, 4):
        for seq in results[1]:
            np.testing.assert_allclose(results[tp][seq], results[1][seq], atol=1e-5, rtol=0)
    ref = hf_logits(hf_model(str(model_dir)), fed[0])
    np.testing.assert_allclose(results[4][0], ref, atol=1e-4, rtol=0)


def test_kv_heads_are_replicated_once_per_device_when_tp_exceeds_them(model_dir, cpu_devices):
    from jaxserve.distributed.sharding import kv_head_replicas

    cfg = load_model(model_dir, dtype="float32", mesh=make_mesh(1, cpu_devices)).config
    assert [kv_head_replicas(cfg, tp) for tp in (1, 2, 4)] == [1, 1, 2]
    loaded = load_model(model_dir, dtype="float32", mesh=make_mesh(4, cpu_devices))
    assert loaded.model.num_cache_kv_heads == 4  # 2 KV heads, each on the 2 devices using it


def test_tp_not_dividing_heads_is_a_clear_error(model_dir, cpu_devices):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide .*heads=8"):
        load_model(model_dir, mesh=make_mesh(3, cpu_devices))
    cfg = load_model(model_dir, dtype="float32", mesh=make_mesh(1, cpu_devices)).config
    validate_tp(cfg, 4)  # tp > Hkv but a multiple of it: allowed (KV heads replicated)


def test_tp_larger_than_device_count_is_a_clear_error(cpu_devices):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 needs between 1 and"):
        make_mesh(64, cpu_devices)
