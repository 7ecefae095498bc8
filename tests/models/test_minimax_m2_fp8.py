"""MiniMax-M2 as it is published: fp8 e4m3 weights with 2-D block scales (`weight_scale_inv`)
in the attention and every expert, kept packed; its q / k norms, router and routing bias in
full precision. The reference is transformers' float32 model of the weights as transformers'
own fp8 dequantization decodes them."""

import numpy as np

from jaxserve.models.loader import load_model
from tests.helpers import hf_model, make_tiny_hf
from tests.models.test_fp8_moe import assert_logits_match, fp8_block_checkpoint
from tests.models.test_minimax_m2 import SHAPE

QUANTIZED = ("proj.weight", "w1.weight", "w2.weight", "w3.weight")  # attention and experts


def test_fp8_block_checkpoint_matches_transformers(tmp_path):
    fp8 = make_tiny_hf("minimax_m2", tmp_path / "fp8", **SHAPE)
    stored, decoded = fp8_block_checkpoint(fp8, QUANTIZED)
    assert "model.layers.0.block_sparse_moe.experts.0.w2.weight_scale_inv" in stored
    assert "model.layers.0.self_attn.q_norm.weight_scale_inv" not in stored
    loaded = load_model(str(fp8), dtype="float32")
    assert loaded.config.quantization == "fp8_block" and loaded.config.expert_quant == "fp8_block"
    layer = loaded.model.layers[0]
    assert str(layer.self_attn.qkv_proj.kernel[...].dtype) == "float8_e4m3fn"
    assert str(layer.mlp.w13[...].dtype) == "float8_e4m3fn"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5)]
    assert_logits_match(loaded, hf_model(str(decoded)), prompts)
