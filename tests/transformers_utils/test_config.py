"""transformers_utils: a model's config, generation config and tokenizer read without any
model code; a GGUF's config from its metadata."""

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
