"""MiniMax-M2 as it is published: fp8 e4m3 weights with 2-D block scales (`weight_scale_inv`)
in the attention and every expert, kept packed; its q / k norms, router and routing bias in
full precision. The reference is transformers' float32 model of the weights as transformers'
own fp8 dequantization decodes them."""

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from jaxserve.models.loader import load_model
from tests.helpers import hf_logits, hf_model, make_tiny_hf
from tests.models.test_fp8_moe import BLOCK, quantize
from tests.models.test_llama_parity import run_mixed_schedule
from tests.models.test_minimax_m2 import SHAPE

QUANTIZED = ("proj.weight", "w1.weight", "w2.weight", "w3.weight")  # attention and experts


def test_fp8_block_checkpoint_matches_transformers(tmp_path):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    fp8 = make_tiny_hf("minimax_m2", tmp_path / "fp8", **SHAPE)
    decoded = tmp_path / "decoded"
    shutil.copytree(fp8, decoded)
    stored, floats = {}, {}
    for name, w in load_file(fp8 / "model.safetensors").items():
        if ".layers." in name and name.endswith(QUANTIZED):
            q, s = quantize(w)
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            floats[name] = _dequantize_fp8_weight(q, s, [BLOCK, BLOCK], torch.float32)
        else:
            stored[name] = floats[name] = w
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, decoded / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (fp8 / "config.json").write_text(json.dumps(config))

    loaded = load_model(str(fp8), dtype="float32")
    assert loaded.config.quantization == "fp8_block" and loaded.config.expert_quant == "fp8_block"
    layer = loaded.model.layers[0]
    assert str(layer.self_attn.qkv_proj.kernel[...].dtype) == "float8_e4m3fn"
    assert str(layer.mlp.w13[...].dtype) == "float8_e4m3fn"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5)]
    fed, logits = run_mixed_schedule(loaded, prompts)
    ref = hf_model(str(decoded))
    for seq, tokens in fed.items():
        want = hf_logits(ref, tokens)
        np.testing.assert_allclose(logits[seq], want, atol=1e-3 * np.abs(want).max(), rtol=0)
        assert (logits[seq].argmax(-1) == want.argmax(-1)).all()
