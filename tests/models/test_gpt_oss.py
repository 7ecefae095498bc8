"""gpt-oss checkpoints as OpenAI ships them: the experts in MXFP4 (`*_blocks` / `*_scales`,
quant_method mxfp4), dequantized as they load exactly as transformers dequantizes them on a
CPU. (The unquantized family's parity, tensor and expert parallel and engine generate are
test_moe.py's and test_family_generate.py's.)"""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxserve.models.gpt_oss import dequantize_mxfp4_experts
from jaxserve.models.loader import load_model
from tests.helpers import hf_logits, make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule
from tests.models.test_moe import FAMILIES


def test_experts_dequantize_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)  # every code, both nibbles
    scales = rng.integers(110, 140, (3, 10, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32)  # fmt: skip
    got = dequantize_mxfp4_experts(blocks, scales)
    assert got.shape == (3, 128, 10)  # [E, in, out]
    np.testing.assert_array_equal(got, want.numpy())


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """A tiny gpt-oss whose experts are hand-packed MXFP4: random e2m1 codes and exponents
    written as `*_blocks` / `*_scales` in place of the float experts, the config saying
    quant_method mxfp4 (with gpt-oss's modules_to_not_convert)."""
    path = make_tiny_hf("gpt_oss", tmp_path_factory.mktemp("gpt_oss_mxfp4"), **FAMILIES["gpt_oss"])
    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(1)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = weights.pop(name).shape
        weights[f"{name}_blocks"] = rng.integers(0, 256, (e, d_out, d_in // 32, 16), np.uint8)
        weights[f"{name}_scales"] = rng.integers(121, 124, (e, d_out, d_in // 32), np.uint8)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mxfp4_checkpoint_matches_transformers(mxfp4_dir):
    """Logits of a mixed prefill / decode schedule equal those of transformers' own load of
    the checkpoint (Mxfp4Config(dequantize=True), as it runs on a CPU) within 1e-4."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    ref = AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    loaded = load_model(mxfp4_dir, dtype="float32", quantization="mxfp4")  # vLLM's -q name
    w13 = np.asarray(loaded.model.layers[1].mlp.w13[...])
    np.testing.assert_array_equal(
        w13, ref.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 256, n).tolist() for n in (13, 4)]
    fed, logits = run_mixed_schedule(loaded, prompts)
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_mxfp4_is_gpt_oss_only(tmp_path):
    """quant_method mxfp4 on another architecture is refused, naming it (jaxserve reads
    gpt-oss's expert layout only)."""
    path = make_tiny_hf("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mxfp4.*GptOssForCausalLM.*LlamaForCausalLM"):
        load_model(path, dtype="float32")
