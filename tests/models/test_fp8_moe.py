"""DeepSeek-V3 / R1 / Kimi K2 as published: every decoder linear layer fp8 e4m3 with 2-D block
scales (HF `quant_method: fp8`, `weight_block_size`, `weight_scale_inv`), the routed experts
included (kept packed: fp8 values and a scale per block), and kv_a_proj_with_mqa's rows not a
multiple of the block (a partial edge block; DeepSeek-V3's 576 rows in 128-row blocks). A tiny
DeepSeek-V3 quantized here in that layout; the reference is transformers' float32 model of the
weights as transformers' own fp8 dequantization (finegrained_fp8._dequantize_fp8_weight, the
one that takes partial blocks) decodes them."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxserve.layers.fused_moe import configure_moe
from jaxserve.models.loader import load_model
from tests.helpers import hf_logits, make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule
from tests.models.test_moe import FAMILIES

BLOCK = 32
# the decoder's linear layers (DeepSeek-V3's own checkpoints quantize exactly these)
LINEAR = ("proj.weight", "proj_with_mqa.weight")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 [out, in], weight_scale_inv f32 [ceil(out / B), in / B]): each
    block's largest magnitude maps to 448; the last block row may be partial."""
    out, d_in = w.shape
    rows = -(-out // BLOCK) * BLOCK
    padded = torch.zeros(rows, d_in).index_copy_(0, torch.arange(out), w.float())
    blocks = padded.reshape(rows // BLOCK, BLOCK, d_in // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    q = (blocks / scale[:, None, :, None]).reshape(rows, d_in)[:out]
    return q.to(torch.float8_e4m3fn), scale


def fp8_block_checkpoint(fp8: Path, quantized: tuple[str, ...]) -> tuple[dict, Path]:
    """Quantize the saved float model `fp8` in place as the published FP8 builds store it: the
    decoder's tensors whose names end with one of `quantized` fp8 with 32 x 32 block scales
    (`weight_scale_inv`), `quant_method: fp8` in its config. Returns (its tensors, a copy
    beside it of the float weights transformers' own fp8 dequantization decodes from them)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    decoded = fp8.parent / f"{fp8.name}-decoded"
    shutil.copytree(fp8, decoded)
    stored, floats = {}, {}
    for name, w in load_file(fp8 / "model.safetensors").items():
        if ".layers." in name and name.endswith(quantized):
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
    return stored, decoded


def assert_fp8_generates_as_hf(fp8: Path, decoded: Path, **engine) -> None:
    """The fp8 checkpoint through the engine (2 rows, 16-token chunks, prefix caching on, a
    pool small enough to preempt: `engine`'s num_gpu_blocks_override): greedy tokens and
    logprobs of four prompts equal HF generate on the decoded weights, nothing leaked."""
    from jaxserve.entrypoints.llm import LLM
    from tests.helpers import assert_generate_matches_hf, core_of

    llm = LLM(str(fp8), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=96,
              dtype="float32", **engine)  # fmt: skip
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 19, 30, 7)]
    assert_generate_matches_hf(llm, decoded, prompts, max_tokens=12)
    scheduler = core_of(llm).scheduler
    assert scheduler.total_preemptions > 0
    scheduler.kv_cache_manager.check_no_leaks()


def assert_logits_match(loaded, ref, prompts: list[list[int]]) -> None:
    """The loaded model's logits over a mixed schedule are the reference's within 1e-3 of
    their scale, and its greedy tokens the reference's."""
    fed, logits = run_mixed_schedule(loaded, prompts)
    for seq, tokens in fed.items():
        want = hf_logits(ref, tokens)
        np.testing.assert_allclose(logits[seq], want, atol=1e-3 * np.abs(want).max(), rtol=0)
        assert (logits[seq].argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the fp8 checkpoint, the float checkpoint of the weights transformers decodes from it)."""
    root = tmp_path_factory.mktemp("deepseek_fp8")
    shape = {**FAMILIES["deepseek_v3"], "moe_intermediate_size": 64}
    fp8 = make_tiny_hf("deepseek_v3", root / "fp8", **shape)
    stored, decoded = fp8_block_checkpoint(fp8, LINEAR)
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)
    return fp8, decoded


@pytest.fixture(scope="module")
def reference(checkpoints):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoints[1], dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    return ref, [rng.integers(1, 256, n).tolist() for n in (11, 5)]


def test_fp8_block_checkpoint_loads_packed_and_matches_transformers(checkpoints, reference):
    """The experts stay fp8 with block scales (1 byte a weight and a float32 per 32 x 32
    block, repeated over the block's columns), the partial edge block loads, and the logits
    are transformers' within 1e-3 of their scale, the greedy tokens its."""
    ref, prompts = reference
    loaded = load_model(checkpoints[0], dtype="float32")
    c = loaded.config
    assert (c.quantization, c.quant_group, c.expert_quant, c.expert_group) == (
        "fp8_block",
        32,
        "fp8_block",
        32,
    )
    mlp = loaded.model.layers[1].mlp
    assert str(mlp.w13[...].dtype) == "float8_e4m3fn" and mlp.w13[...].shape == (8, 64, 128)
    assert mlp.w13_scale[...].shape == (8, 2, 128) and mlp.w2_scale[...].shape == (8, 2, 64)
    kv_a = loaded.model.layers[1].self_attn.kv_a_proj_with_mqa
    assert kv_a.kernel[...].shape == (64, 40) and kv_a.scale[...].shape == (2, 40)
    assert_logits_match(loaded, ref, prompts)


@pytest.mark.parametrize("ep", [False, True])
def test_tp2_and_ep2_equal_one_device(checkpoints, reference, ep):
    _, prompts = reference
    one = run_mixed_schedule(load_model(checkpoints[0], dtype="float32"), prompts)[1]
    split = load_model(
        checkpoints[0], dtype="float32", tensor_parallel_size=2, enable_expert_parallel=ep
    )
    configure_moe(split.model, split.mesh)
    scale = split.model.layers[1].mlp.w13_scale[...]
    assert scale.addressable_shards[0].data.shape == ((4, 2, 128) if ep else (8, 2, 64))
    two = run_mixed_schedule(split, prompts)[1]
    for seq in one:
        np.testing.assert_allclose(two[seq], one[seq], atol=1e-5, rtol=0)
