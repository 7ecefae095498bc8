"""Qwen3.5-MoE as its FP8 builds are published: the decoder's linear layers fp8 e4m3 with
2-D block scales (`weight_scale_inv`), the routed and shared experts included, the linear
attention's small in_proj_a / in_proj_b left in full precision. The attention, MLP, experts
and the gated delta-net's projections (regrouped per key head as they load, their 32 x 32
blocks spanning heads the regrouping reorders) stay packed. The reference is transformers'
float32 model of the weights as transformers' own fp8 dequantization decodes them."""

import numpy as np

from jaxserve.models.loader import load_model
from tests.helpers import hf_model, make_tiny_hf
from tests.models.test_fp8_moe import (
    assert_fp8_generates_as_hf,
    assert_logits_match,
    fp8_block_checkpoint,
)
from tests.models.test_qwen3_5 import MOE, SHAPE

# the linear layers FP8 builds quantize (not in_proj_a / in_proj_b, a row per value head)
QUANTIZED = ("proj.weight", "in_proj_qkv.weight", "in_proj_z.weight")


def test_fp8_block_checkpoint_matches_transformers(tmp_path):
    shape = {**SHAPE, **MOE, "shared_expert_intermediate_size": 64}  # whole 32-wide blocks
    fp8 = make_tiny_hf("qwen3_5_moe", tmp_path / "fp8", **shape)
    stored, decoded = fp8_block_checkpoint(fp8, QUANTIZED)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv" in stored
    loaded = load_model(str(fp8), dtype="float32")
    assert loaded.config.quantization == "fp8_block" and loaded.config.expert_quant == "fp8_block"
    layer = loaded.model.layers[1]
    assert str(layer.self_attn.qkv_proj.kernel[...].dtype) == "float8_e4m3fn"
    assert str(layer.mlp.w13[...].dtype) == "float8_e4m3fn"
    linear = loaded.model.layers[0].linear_attn
    for proj in (linear.in_proj_qkvz, linear.out_proj):
        assert str(proj.kernel[...].dtype) == "float8_e4m3fn"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5)]
    assert_logits_match(loaded, hf_model(str(decoded)), prompts)


def test_fp8_block_checkpoint_generates_as_transformers_with_preemption(tmp_path, monkeypatch):
    """The FP8 Qwen3.5-MoE through the engine: prompts prefilled in 16-token chunks, preempted
    by a 5-block pool and recomputed, prefix caching on; greedy tokens and logprobs equal HF
    generate on the weights transformers' fp8 dequantization decodes, nothing leaked."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    shape = {**SHAPE, **MOE, "shared_expert_intermediate_size": 64}
    fp8 = make_tiny_hf("qwen3_5_moe", tmp_path / "fp8", **shape)
    _, decoded = fp8_block_checkpoint(fp8, QUANTIZED)
    assert_fp8_generates_as_hf(fp8, decoded, num_gpu_blocks_override=5)
