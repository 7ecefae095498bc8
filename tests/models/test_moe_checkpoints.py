"""Mixture-of-experts checkpoints quantized by their formats' own tools, the routed experts
included: a tiny Qwen3-MoE (tests/data/quantized/*-moe-*, made by
scripts/make_quantized_checkpoints.py in the tools' own venvs). llm-compressor: weight-only fp8
in 64 x 64 blocks, W4A16 (int4, a scale per 64 inputs) and MXFP4A16 (e2m1, an e8m0 exponent
per 32 inputs); their reference is transformers' float32 logits of the checkpoint as
compressed-tensors' own compressor decompresses each layer, and that decompression of one
expert's down_proj. GPTQModel's GPTQ int4 g64: its reference is the checkpoint as GPTQModel
dequantizes each linear layer, experts included, run in float32. The experts stay packed."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.fused_moe import configure_moe
from jaxserve.models.loader import load_model
from tests.models.test_int4 import assert_matches_recorded, prompts_and_reference
from tests.models.test_llama_parity import run_mixed_schedule

DATA = Path(__file__).resolve().parents[1] / "data" / "quantized"
E, D, F = 8, 128, 128
# format: (kernel dtype, bytes of one expert's three projections, packed)
FORMATS = {
    "ct-moe-fp8-block": ("float8_e4m3fn", "fp8_block", 3 * D * F + 3 * 4 * 2 * F),
    "ct-moe-w4a16": ("uint8", "int4", 3 * D * F // 2 + 3 * 2 * 4 * 2 * F),
    "ct-moe-mxfp4a16": ("uint8", "mxfp4", 3 * D * F // 2 + 3 * D * F // 32),
    "gptq-moe-w4-g64": ("uint8", "int4", 3 * D * F // 2 + 3 * 2 * 4 * 2 * F),
}
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"  # in the ct-moe reference_dequant


@pytest.mark.parametrize("name", FORMATS)
def test_experts_stay_packed_and_match_compressed_tensors(name):
    kernel_dtype, mode, expert_bytes = FORMATS[name]
    loaded = load_model(DATA / name, dtype="float32")
    assert (loaded.config.quantization, loaded.config.expert_quant) == (mode, mode)
    mlp = loaded.model.layers[1].mlp
    assert str(mlp.w13[...].dtype) == kernel_dtype
    assert mlp.experts("w13").nbytes + mlp.experts("w2").nbytes == E * expert_bytes
    if name.startswith("ct-"):  # one expert's down_proj decoded [F, D]: the library's [D, F]
        want = np.load(DATA / name / "reference_dequant.npz")[EXPERT]
        got = np.asarray(mlp.experts("w2").expert(3, jnp.float32))
        np.testing.assert_allclose(got.T, want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert_matches_recorded(loaded, DATA / name)


@pytest.mark.parametrize(("name", "ep"), [("ct-moe-w4a16", False), ("ct-moe-fp8-block", True)])
def test_tensor_and_expert_parallel_equal_one_device(name, ep):
    """tp 2: every expert's 64 of 128 columns a device (whole 64-input groups of w2); ep 2:
    4 whole packed experts a device; the logits are one device's."""
    path = DATA / name
    prompts = prompts_and_reference(path)[0]
    one = run_mixed_schedule(load_model(path, dtype="float32"), prompts)[1]
    split = load_model(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=ep)
    configure_moe(split.model, split.mesh)
    scale = split.model.layers[0].mlp.w2_scale[...]  # [E, F / 64, D]
    assert scale.addressable_shards[0].data.shape == ((E // 2, 2, D) if ep else (E, 1, D))
    two = run_mixed_schedule(split, prompts)[1]
    for seq in one:
        np.testing.assert_allclose(two[seq], one[seq], atol=1e-5, rtol=0)
