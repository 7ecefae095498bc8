"""Loading weights (safetensors, sharded, bfloat16) and what a bad model path or file does."""

import json
import shutil

import jax
import numpy as np
import pytest

from jaxserve.models.loader import load_model
from tests.helpers import make_tiny_hf


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))


def _copy(model_dir, tmp_path):
    return shutil.copytree(model_dir, tmp_path / "m")


def _params(loaded):
    from flax import nnx

    return jax.tree.leaves(nnx.state(loaded.model))


def test_sharded_safetensors_with_index(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(out, max_shard_size="50KB")
    assert (out / "model.safetensors.index.json").exists()
    a, b = load_model(model_dir, dtype="float32"), load_model(out, dtype="float32")
    for x, y in zip(_params(a), _params(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_bfloat16_weights(model_dir):
    loaded = load_model(model_dir, dtype="bfloat16")
    assert {p.dtype for p in _params(loaded)} == {jax.numpy.dtype(jax.numpy.bfloat16)}


def test_unknown_architecture(model_dir, tmp_path):
    m = _copy(model_dir, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'FooForCausalLM' is not supported.*LlamaForCausalLM"):
        load_model(m)


def test_missing_weight_file(model_dir, tmp_path):
    m = _copy(model_dir, tmp_path)
    (m / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weight files in .*m"):
        load_model(m)


def test_missing_shard_named_by_the_index(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(out, max_shard_size="50KB")
    victim = sorted(out.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(out)


def test_truncated_weight_file(model_dir, tmp_path):
    m = _copy(model_dir, tmp_path)
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(m)


def test_missing_tensor_is_named(model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    m = _copy(model_dir, tmp_path)
    tensors = load_file(m / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, m / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(m)


def test_missing_path_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        load_model(tmp_path)


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match=r"bad\.gguf"):
        load_model(f)
