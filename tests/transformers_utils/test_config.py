"""transformers_utils: a model's config, generation config and tokenizer read without any
model code; a GGUF's config from its metadata."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.transformers_utils.config import GGUFConfig, read_model_config


def _write_gguf(path, arch="llama", tensors=("token_embd.weight",)):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(32)
    for name in tensors:
        w.add_tensor(name, np.zeros((32, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_config_from_metadata(tmp_path):
    tied = read_model_config(_write_gguf(tmp_path / "tied.gguf"))
    assert isinstance(tied.hf_config, GGUFConfig)
    assert (tied.architecture, tied.num_layers, tied.hidden_size) == ("LlamaForCausalLM", 1, 8)
    assert (tied.num_heads, tied.num_kv_heads, tied.head_dim, tied.vocab_size) == (2, 1, 4, 32)
    assert tied.tie_word_embeddings  # no output.weight: the lm_head is the embedding
    untied = read_model_config(
        _write_gguf(tmp_path / "untied.gguf", tensors=("token_embd.weight", "output.weight"))
    )
    assert not untied.tie_word_embeddings


def test_gguf_of_another_architecture_is_named(tmp_path):
    path = _write_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'qwen2' in .*qwen\.gguf is not"):
        read_model_config(path)


def test_imports_no_model_code():
    code = (
        "import sys, jaxserve.transformers_utils.config, jaxserve.transformers_utils.tokenizer;"
        " print(sorted(m for m in sys.modules if m.startswith(('jaxserve.models',"
        " 'jaxserve.layers', 'jaxserve.worker', 'flax', 'pallas_kernels',"
        " 'jax.experimental.pallas'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral",
            "qwen3_moe"]  # fmt: skip


def _tiny_config_dir(family: str, path):
    import transformers

    from tests.helpers import TINY

    name = {"qwen3_moe": "Qwen3Moe", "phi3": "Phi3"}.get(family, family.capitalize())
    config_cls = "Gemma3TextConfig" if family == "gemma3" else f"{name}Config"
    config = getattr(transformers, config_cls)(**TINY)
    config.architectures = [f"{name}ForCausalLM"]
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_config_reads_as_transformers_resolves_it(family, tmp_path, monkeypatch):
    """The plain copy kept under JAXSERVE_CONFIG_CACHE gives the ModelConfig transformers'
    own config gives, class defaults and attribute aliases included."""
    from transformers import AutoConfig

    from jaxserve.config import ModelConfig
    from jaxserve.transformers_utils.config import read_hf_config

    monkeypatch.setenv("JAXSERVE_CONFIG_CACHE", str(tmp_path / "cache"))
    model_dir = _tiny_config_dir(family, tmp_path / "model")
    resolved = AutoConfig.from_pretrained(model_dir)
    first, again = read_hf_config(model_dir), read_hf_config(model_dir)  # written, then read
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    assert vars(first) == vars(again)
    want = ModelConfig.from_hf(resolved)
    assert ModelConfig.from_hf(again) == want
    for alias, name in resolved.attribute_map.items():
        assert getattr(again, alias) == getattr(resolved, name)
    assert again.to_transformers().to_dict() == resolved.to_dict()


def test_a_second_start_reads_the_config_without_transformers(tmp_path, monkeypatch):
    from jaxserve.transformers_utils.config import read_hf_config

    cache = tmp_path / "cache"
    monkeypatch.setenv("JAXSERVE_CONFIG_CACHE", str(cache))
    model_dir = _tiny_config_dir("llama", tmp_path / "model")
    assert read_hf_config(model_dir).num_hidden_layers == 3  # resolved by transformers, kept
    code = (
        "import sys; from jaxserve.transformers_utils.config import read_model_config;"
        f" c = read_model_config({str(model_dir)!r});"
        " print(c.num_layers, 'transformers' in sys.modules)"
    )
    env = {**os.environ, "JAXSERVE_CONFIG_CACHE": str(cache)}
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env=env)  # fmt: skip
    assert again.stdout.split() == ["3", "False"]
    config_json = model_dir / "config.json"  # an edited config.json is another entry
    config_json.write_text(
        config_json.read_text().replace('"num_hidden_layers": 3', '"num_hidden_layers": 2')
    )
    assert read_hf_config(model_dir).num_hidden_layers == 2
    assert len(list(cache.glob("*.json"))) == 2
    monkeypatch.setenv("JAXSERVE_CONFIG_CACHE", "0")  # no cache: nothing written
    config_json.write_text(
        config_json.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 1')
    )
    assert read_hf_config(model_dir).num_hidden_layers == 1
    assert len(list(cache.glob("*.json"))) == 2
