"""A GGUF file written here the way llama.cpp's converter writes one (q/k rows permuted, mixed
quantisation types) loads into the same logits as HF on the identically rounded weights."""

import dataclasses

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.distributed.sharding import validate_tp
from jaxserve.models.loader import load_model
from jaxserve.models.weight_sources import gguf_blocks
from tests.helpers import hf_logits, make_tiny_hf, write_llama_gguf
from tests.models.test_llama_parity import run_mixed_schedule

Q = gguf.GGMLQuantizationType
QTYPES = {  # GGUF name suffix -> quantisation; a mix of what llama.cpp writes
    "attn_q.weight": Q.F16,
    "attn_k.weight": Q.Q4_0,
    "attn_v.weight": Q.Q4_1,
    "attn_output.weight": Q.Q5_0,
    "ffn_gate.weight": Q.Q5_1,
    "ffn_up.weight": Q.BF16,
    "ffn_down.weight": Q.Q8_0,
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q4_1,
}


@pytest.fixture(scope="module")
def gguf_and_reference(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, hf, QTYPES)  # HF's weights become the rounded ones
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


KEPT = {  # every legacy block format, mixed inside the fused qkv and gate_up kernels
    "attn_q.weight": Q.Q8_0,
    "attn_k.weight": Q.Q4_0,
    "attn_v.weight": Q.Q4_1,
    "attn_output.weight": Q.Q5_0,
    "ffn_gate.weight": Q.Q5_1,
    "ffn_up.weight": Q.Q4_1,
    "ffn_down.weight": Q.Q8_0,
}


@pytest.fixture(scope="module")
def kept_gguf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, hf, KEPT)
    return path, hf


@pytest.mark.parametrize("tp", [1, 2])
def test_gguf_blocks_kept_quantized_give_the_same_logits(kept_gguf, tp):
    """--quantization gguf: the decoder layers' kernels stay in their blocks (int8 q, one d
    and m per 16 input rows: 1.5 bytes a weight, not 4) and rebuild exactly the weights the
    dequantizing load gives, so the logits are HF's on the rounded weights."""
    path, hf = kept_gguf
    loaded = load_model(path, dtype="float32", quantization="gguf", tensor_parallel_size=tp)
    full = load_model(path, dtype="float32")
    kernels = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}

    def linear_bytes(model):
        state = nnx.to_flat_state(nnx.state(model))
        return sum(v.get_value().nbytes for p, v in state if any(k in p for k in kernels))

    assert loaded.model.layers[0].mlp.down_proj.kernel[...].dtype == jnp.int8
    assert linear_bytes(loaded.model) * 2.5 < linear_bytes(full.model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, n).tolist() for n in (10, 6)]
    fed, logits = run_mixed_schedule(loaded, prompts)
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(hf, tokens), atol=1e-4, rtol=0)


def _random_k_blocks(rng, qtype: str, rows: int, num_in: int) -> np.ndarray:
    """Random raw K-quant super-blocks (gguf-py cannot quantize to them) with small, finite
    f16 scales: uint8 [rows, bytes per row]."""
    nbytes, d_at = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[qtype]
    raw = rng.integers(0, 256, size=(rows, num_in // 256, nbytes), dtype=np.uint8)
    for at in d_at:
        d = rng.uniform(1e-3, 1e-2, size=(rows, num_in // 256)).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"])
def test_kept_blocks_rebuild_exactly_what_gguf_dequantizes(qtype):
    """d * q + m per 16 inputs equals gguf-py's (llama.cpp's) dequantisation bit for bit."""
    rng = np.random.default_rng(0)
    rows, num_in = 6, 512
    if qtype.endswith("_K"):
        raw = _random_k_blocks(rng, qtype, rows, num_in)
    else:
        raw = gguf.quants.quantize(rng.normal(size=(rows, num_in)).astype(np.float32), Q[qtype])
    want = gguf.quants.dequantize(raw, Q[qtype]).reshape(rows, num_in)
    q, d, m = gguf_blocks(raw, qtype, num_in)
    assert q.dtype == np.int8 and d.shape == m.shape == (rows, num_in // 16)
    got = q.reshape(rows, -1, 16).astype(np.float32) * d[..., None] + m[..., None]
    np.testing.assert_array_equal(got.reshape(rows, num_in), want)


def test_gguf_blocks_need_a_supported_format_and_whole_runs(gguf_and_reference, kept_gguf):
    with pytest.raises(ValueError, match="F16 blocks cannot stay quantized"):
        load_model(gguf_and_reference[0], quantization="gguf")  # its attn_q is F16
    config = dataclasses.replace(
        load_model(kept_gguf[0], quantization="gguf", load_tokenizer=False).config,
        num_heads=6, head_dim=8,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match="num_attention_heads \\* head_dim=48 into whole gguf groups of 16"
    ):
        validate_tp(config, 2)  # 24 rows a device: one run and a half


def test_gguf_config_reads_as_transformers_llama_config(gguf_and_reference):
    """The GGUF's config is built without importing transformers; the model config it gives
    is the one transformers' LlamaConfig of the same fields gives (linear rope scaling too)."""
    from jaxserve.config import ModelConfig
    from jaxserve.transformers_utils.config import GGUFConfig, read_model_config

    config = read_model_config(gguf_and_reference[0])
    assert isinstance(config.hf_config, GGUFConfig)
    scaled = GGUFConfig(
        **{**vars(config.hf_config), "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    )
    for light in (config.hf_config, scaled):
        assert ModelConfig.from_hf(light) == ModelConfig.from_hf(light.to_transformers())
    assert ModelConfig.from_hf(scaled).rope != config.rope
