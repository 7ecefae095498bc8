"""The converted-weight cache: a second load of a GGUF file reads the arrays the first one
placed (no dequantization) and gives the same parameters; a changed model file, dtype,
quantization or source is another entry; a bad entry is ignored, deleted and written again."""

import json
import os

import jax
import numpy as np
import pytest
import torch
from flax import nnx, traverse_util

from jaxserve.models import loader, weight_cache
from jaxserve.models.loader import load_model
from jaxserve.transformers_utils.config import read_model_config
from tests.helpers import make_tiny_hf, write_llama_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, hf, {"ffn_down.weight": Q.Q4_1, "attn_v.weight": Q.Q8_0})
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_WEIGHT_CACHE", str(tmp_path / "weights"))
    return tmp_path / "weights"


def params(loaded) -> dict:
    state = nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param))
    return jax.tree.map(np.asarray, state)


def targets(path) -> dict:
    """The model's parameters as ShapeDtypeStructs, by path."""
    config = read_model_config(path, "float32")
    _, state = loader._abstract_model(loader.get_model_class(config.architecture), config, 1)
    return traverse_util.flatten_dict(nnx.to_pure_dict(state))


def entries(cache) -> list:
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(".tmp-"))


def no_reading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the GGUF was read: the cached weights were not used")

    monkeypatch.setattr(loader, "read_params", fail)


def test_a_second_load_reads_the_cached_weights_and_gives_the_same_parameters(
    gguf_path, cache, monkeypatch
):
    first = load_model(gguf_path, dtype="float32", load_tokenizer=False)
    (entry,) = entries(cache)
    written = (cache / entry / "data.bin").stat().st_mtime_ns
    with monkeypatch.context() as m:
        no_reading(m)
        second = load_model(gguf_path, dtype="float32", load_tokenizer=False)
    jax.tree.map(np.testing.assert_array_equal, params(second), params(first))
    assert entries(cache) == [entry] and (cache / entry / "data.bin").stat().st_mtime_ns == written

    # int8 kernels (and their scales) are cached as they were quantized at load
    int8 = load_model(gguf_path, dtype="float32", quantization="int8", load_tokenizer=False)
    assert len(entries(cache)) == 2
    with monkeypatch.context() as m:
        no_reading(m)
        again = load_model(gguf_path, dtype="float32", quantization="int8", load_tokenizer=False)
    jax.tree.map(np.testing.assert_array_equal, params(again), params(int8))


def test_a_changed_file_dtype_or_source_is_another_entry(gguf_path, cache, monkeypatch):
    config = read_model_config(gguf_path, "float32")
    key = weight_cache.key(gguf_path, config, 1)
    assert weight_cache.key(gguf_path, config, 1) == key  # deterministic
    assert weight_cache.key(gguf_path, read_model_config(gguf_path, "bfloat16"), 1) != key
    assert weight_cache.key(gguf_path, config, 2) != key  # KV heads replicated for tp
    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # rewritten in place
    try:
        assert weight_cache.key(gguf_path, config, 1) != key
    finally:
        os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.setattr(weight_cache, "source_digest", lambda: "other jaxserve sources")
    assert weight_cache.key(gguf_path, config, 1) != key


def test_a_bad_entry_is_ignored_deleted_and_written_again(gguf_path, cache, caplog):
    first = load_model(gguf_path, dtype="float32", load_tokenizer=False)
    (entry,) = cache.iterdir()
    index = json.loads((entry / "index.json").read_text())
    index[0][2] = [index[0][2][0] + 1, *index[0][2][1:]]  # a shape the model does not have
    (entry / "index.json").write_text(json.dumps(index))
    again = load_model(gguf_path, dtype="float32", load_tokenizer=False)
    assert "ignoring the weight cache" in caplog.text
    jax.tree.map(np.testing.assert_array_equal, params(again), params(first))
    assert weight_cache.read(entry.name, targets(gguf_path)) is not None  # written again


def test_the_cache_can_be_turned_off(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_WEIGHT_CACHE", "0")
    monkeypatch.setenv("HOME", str(tmp_path))
    load_model(gguf_path, dtype="float32", load_tokenizer=False)
    assert not list(tmp_path.rglob("index.json"))
