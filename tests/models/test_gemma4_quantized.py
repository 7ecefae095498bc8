"""Gemma 4 from pre-quantized checkpoints, the attention's and MLPs' linear layers kept packed
(the per-layer-input projections in full precision): fp8 e4m3 with 2-D block scales
(`weight_scale_inv`, as the published FP8 builds of other families store them), against
transformers' float32 model of the weights its own fp8 dequantization decodes; and
compressed-tensors' W4A16 (a scale per 16 inputs, as the published QAT w4a16 builds are
made), against transformers over the layers as compressed-tensors decompresses them
(recorded by scripts/make_quantized_checkpoints.py gemma4). The fused q / k (/ v) kernel
keeps its blocks packed, the full layers' one KV head repeated with its scales."""

from pathlib import Path

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.models.loader import load_model
from tests.helpers import hf_model, make_tiny_hf
from tests.models.test_fp8_moe import (
    assert_fp8_generates_as_hf,
    assert_logits_match,
    fp8_block_checkpoint,
)
from tests.models.test_int4 import assert_generates_as_recorded, assert_matches_recorded
from tests.models.test_llama_parity import FAMILIES

# the dense build (the 31B's layout: no experts), every other feature of the tiny Gemma 4
DENSE = {**FAMILIES["gemma4"][1], "enable_moe_block": False}
QUANTIZED = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))


def test_fp8_block_checkpoint_matches_transformers(tmp_path):
    fp8 = make_tiny_hf("gemma4", tmp_path / "fp8", **DENSE)
    stored, decoded = fp8_block_checkpoint(fp8, QUANTIZED)
    assert "model.layers.1.self_attn.k_proj.weight_scale_inv" in stored
    loaded = load_model(str(fp8), dtype="float32")
    assert loaded.config.quantization == "fp8_block"
    layer = loaded.model.layers[1]  # a full layer: its key head repeated into two cache heads
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.dense_mlp.down_proj):
        assert str(linear.kernel[...].dtype) == "float8_e4m3fn"
    assert str(layer.per_layer_input_gate.kernel[...].dtype) == "float32"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5)]
    assert_logits_match(loaded, hf_model(str(decoded)), prompts)


def test_fp8_block_checkpoint_generates_as_transformers_at_tp_2(tmp_path, monkeypatch):
    """Through the engine at tp 2 (the fused kernel's blocks split with its heads): prompts
    prefilled in 16-token chunks, preempted and recomputed, prefix caching on; greedy tokens
    and logprobs equal HF generate on the decoded weights, nothing leaked."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    fp8 = make_tiny_hf("gemma4", tmp_path / "fp8", **DENSE)
    _, decoded = fp8_block_checkpoint(fp8, QUANTIZED)
    assert_fp8_generates_as_hf(fp8, decoded, num_gpu_blocks_override=11, tensor_parallel_size=2)


INT4 = Path(__file__).resolve().parents[1] / "data" / "quantized" / "ct-gemma4-w4a16"


def test_int4_checkpoint_stays_packed_and_matches_compressed_tensors():
    loaded = load_model(INT4, dtype="float32")
    assert loaded.config.quantization == "int4"
    layer = loaded.model.layers[1]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.dense_mlp.gate_up_proj):
        assert str(linear.kernel[...].dtype) == "uint8"
    assert_matches_recorded(loaded, INT4)


@pytest.mark.parametrize("tp", [1, 2])
def test_int4_checkpoint_generates_as_recorded_with_preemption(tp, monkeypatch):
    """Through the engine: 16-token chunks, preemption, prefix caching on; greedy tokens equal
    and logprobs within 1e-2 of transformers' generate over the decompressed layers, at tp 1
    and 2; nothing leaked."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(INT4), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=96,
              dtype="float32", num_gpu_blocks_override=11, tensor_parallel_size=tp)  # fmt: skip
    assert_generates_as_recorded(llm, INT4)
