"""A GGUF file written here the way llama.cpp's converter writes one (q/k rows permuted, mixed
quantisation types) loads into the same logits as HF on the identically rounded weights."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from jaxserve.models.loader import load_model
from tests.helpers import TINY, hf_logits, make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule

Q = gguf.GGMLQuantizationType
TYPES = {  # HF name suffix -> (GGUF name, quantisation)
    "self_attn.q_proj.weight": ("attn_q.weight", Q.F16),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.Q4_0),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.Q4_1),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.Q5_0),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q5_1),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.BF16),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q8_0),
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
}
GLOBAL = {
    "model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0),
    "model.norm.weight": ("output_norm.weight", Q.F32),
    "lm_head.weight": ("output.weight", Q.Q4_1),
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to attn_q / attn_k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def gguf_and_reference(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf.config.rms_norm_eps)
    writer.add_rope_freq_base(hf.config.rope_parameters["rope_theta"])
    writer.add_vocab_size(TINY["vocab_size"])
    state = hf.state_dict()
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            gname, qtype = TYPES[suffix]
            gname = f"blk.{layer}.{gname}"
        else:
            gname, qtype = GLOBAL[name]
        w = tensor.numpy()
        rounded = dequantize(quantize(w, qtype), qtype).reshape(w.shape)  # what HF will see
        tensor.copy_(torch.from_numpy(rounded))
        if gname.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, TINY["num_attention_heads"])
        elif gname.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, TINY["num_key_value_heads"])
        data = quantize(w, qtype)
        writer.add_tensor(gname, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf.load_state_dict(state)
    return path, hf


def test_quantised_gguf_matches_hf_on_rounded_weights(gguf_and_reference):
    path, hf = gguf_and_reference
    loaded = load_model(path, dtype="float32")
    assert not loaded.config.tie_word_embeddings  # the file has an output.weight
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, n).tolist() for n in (10, 6)]
    fed, logits = run_mixed_schedule(loaded, prompts)
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_non_llama_gguf_is_refused(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' in .*falcon\.gguf"):
        load_model(path)
