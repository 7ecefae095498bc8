"""gpt-oss checkpoints as OpenAI ships them: the experts in MXFP4 (`*_blocks` / `*_scales`,
quant_method mxfp4), kept packed (decoded one expert at a time inside the step), the weights
they stand for exactly those transformers dequantizes on a CPU. (The unquantized family's
parity, tensor and expert parallel and engine generate are test_moe.py's and
test_family_generate.py's.)"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxserve.layers.fused_moe import configure_moe
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


def write_mxfp4(path):
    """A tiny gpt-oss whose experts are hand-packed MXFP4: random e2m1 codes and exponents
    written as `*_blocks` / `*_scales` in place of the float experts, the config saying
    quant_method mxfp4 (with gpt-oss's modules_to_not_convert)."""
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


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    tiny = make_tiny_hf("gpt_oss", tmp_path_factory.mktemp("gpt_oss_mxfp4"), **FAMILIES["gpt_oss"])
    return write_mxfp4(tiny)


@pytest.fixture(scope="module")
def reference(mxfp4_dir):
    """transformers' own load of the checkpoint (Mxfp4Config(dequantize=True), as it runs on
    a CPU), and a mixed prefill / decode schedule's prompts."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    ref = AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    rng = np.random.default_rng(2)
    return ref, [rng.integers(1, 256, n).tolist() for n in (13, 4)]


def test_mxfp4_checkpoint_matches_transformers_with_experts_packed(mxfp4_dir, reference):
    """The experts stay packed (4 bits a weight, an exponent per 32), the weights they decode
    to equal transformers' dequantization exactly, and the logits equal its within 1e-4."""
    ref, prompts = reference
    loaded = load_model(mxfp4_dir, dtype="float32", quantization="mxfp4")  # vLLM's -q name
    assert (loaded.config.expert_quant, loaded.config.expert_group) == ("mxfp4", 32)
    mlp = loaded.model.layers[1].mlp
    e, d, f = 8, 64, 128
    assert mlp.w13[...].dtype == mlp.w13_scale[...].dtype == jnp.uint8
    assert mlp.w13[...].shape == (e, d // 2, 2 * f) and mlp.w13_scale[...].shape == (
        e,
        d // 32,
        2 * f,
    )
    assert mlp.w2[...].shape == (e, f // 2, d) and mlp.w2_scale[...].shape == (e, f // 32, d)
    packed = mlp.experts("w13").nbytes + mlp.experts("w2").nbytes
    assert packed == e * 3 * d * f // 2 + e * 3 * d * f // 32  # 4.25 bits a weight
    w13 = np.asarray(mlp.experts("w13").dense(jnp.float32))
    np.testing.assert_array_equal(
        w13, ref.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    )
    fed, logits = run_mixed_schedule(loaded, prompts)
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("tp", "ep"), [(2, False), (2, True), (4, False)])
def test_packed_experts_split_over_devices_match_transformers(mxfp4_dir, reference, tp, ep):
    """Tensor parallel (each device every expert's whole scale groups of F) and expert
    parallel (whole experts a device) keep the experts packed and match transformers."""
    ref, prompts = reference
    split = load_model(
        mxfp4_dir, dtype="float32", tensor_parallel_size=tp, enable_expert_parallel=ep
    )
    configure_moe(split.model, split.mesh)  # as the runner does: per device, under shard_map
    w2 = split.model.layers[0].mlp.w2_scale[...]  # [E, F / 32, D]
    assert split.config.expert_quant == "mxfp4"
    assert w2.addressable_shards[0].data.shape == ((8 // tp, 4, 64) if ep else (8, 4 // tp, 64))
    fed, logits = run_mixed_schedule(split, prompts)
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_tp_that_splits_a_scale_group_loads_the_experts_unpacked(tmp_path):
    """An intermediate size of 96 over tp 2 leaves 48 columns a device, which would split a
    32-input scale: the experts load dequantized instead, and still match transformers."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    tiny = make_tiny_hf("gpt_oss", tmp_path, **{**FAMILIES["gpt_oss"], "intermediate_size": 96})
    path = write_mxfp4(tiny)
    loaded = load_model(path, dtype="float32", tensor_parallel_size=2)
    configure_moe(loaded.model, loaded.mesh)
    assert loaded.config.expert_quant is None
    assert loaded.model.layers[0].mlp.w13[...].dtype == jnp.float32
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    fed, logits = run_mixed_schedule(loaded, [[5, 17, 3, 99, 42]])
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
