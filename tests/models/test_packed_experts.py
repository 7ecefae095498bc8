"""Mixture-of-experts models with their experts packed as the 2026 checkpoints publish them
(MXFP4, int4, fp8 with block scales), from `-q <format> --load-format dummy` on the presets:
packed sizes exact from the shapes, gpt-oss-120b within one 80 GB GPU, and a step that runs.
(Real checkpoints: test_gpt_oss.py's MXFP4; the decoding itself: tests/pallas_kernels.)"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.benchmarks.roofline import param_bytes, param_counts
from jaxserve.models.loader import load_model
from jaxserve.transformers_utils.config import read_model_config
from jaxserve.transformers_utils.model_path import resolve_model_path
from tests.helpers import make_tiny_hf, runner_of
from tests.models.test_llama_parity import run_mixed_schedule

GB = 1e9


@pytest.mark.parametrize(
    ("preset", "shape"),
    [
        ("gpt-oss-120b", (36, 128, 4, 2880)),
        ("qwen3-30b-a3b", (48, 128, 8, 768)),
        ("qwen3-235b-a22b", (94, 128, 8, 1536)),
    ],
)
def test_moe_presets_have_transformers_parameter_count(preset, shape):
    """Each preset's layers, experts, top-k and expert width; two of its layers (every kind of
    weight) have the parameters transformers' own model of the config builds (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(preset, "dummy")
    c = read_model_config(path, "bfloat16")
    assert (c.num_layers, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == shape
    two = read_model_config(path, "bfloat16", hf_overrides={"num_hidden_layers": 2})
    extra = {"layer_types": c.hf_config.layer_types[:2]} if c.layer_types else {}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path, num_hidden_layers=2, **extra)
        )
    assert param_counts(two)[0] == sum(p.numel() for p in hf.parameters())


def test_gpt_oss_120b_packed_fits_one_80gb_gpu_with_a_32k_cache():
    """By the shapes: its MXFP4 experts (4 bits a weight and an 8-bit exponent per 32) are
    exactly 36 x 128 x 3 x 2880^2 x 17/32 bytes, and the whole model plus 32,768 tokens of
    bf16 KV cache is under 80 GB; in bf16 it is not."""
    c = read_model_config(resolve_model_path("gpt-oss-120b", "dummy"), "bfloat16")
    packed = c.with_dummy_packing("mxfp4")
    assert (packed.expert_quant, packed.quantization) == ("mxfp4", None)  # experts only
    total, experts = param_bytes(packed)
    assert experts == 36 * 128 * 3 * 2880 * 2880 * 17 // 32
    kv = 32768 * c.num_layers * c.num_kv_heads * 2 * c.head_dim * 2  # K and V, bf16
    assert total + kv < 80 * GB < param_bytes(c)[0]
    assert param_counts(packed)[0] == param_counts(c)[0]  # the same weights, packed


SMALL = {
    "gpt-oss-20b": {"num_hidden_layers": 2, "num_local_experts": 8, "hidden_size": 128,
                    "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "vocab_size": 512},
    "qwen3-30b-a3b": {"num_hidden_layers": 2, "num_experts": 8, "hidden_size": 256,
                      "intermediate_size": 512, "moe_intermediate_size": 128,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                      "vocab_size": 512},
}  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "mode", "kernel_dtype"),
    [
        ("gpt-oss-20b", "mxfp4", jnp.uint8),
        ("qwen3-30b-a3b", "int4", jnp.uint8),
        ("qwen3-30b-a3b", "fp8_block", jnp.float8_e4m3fn),
    ],
)
def test_packed_dummy_weights_load_packed_and_step(preset, mode, kernel_dtype):
    """`-q mxfp4|int4|fp8_block --load-format dummy`: the experts (and, but for gpt-oss's
    MXFP4, the linear layers) packed, their bytes as the shapes say, and a prefill / decode
    schedule gives finite logits."""
    loaded = load_model(
        preset, load_format="dummy", quantization=mode, dtype="float32", hf_overrides=SMALL[preset]
    )
    c = loaded.config
    assert c.expert_quant == mode
    mlp = loaded.model.layers[0].mlp
    assert mlp.w13[...].dtype == kernel_dtype
    e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
    per_weight = {"mxfp4": 0.5 + 1 / 32, "int4": 0.5 + 8 / 128, "fp8_block": 1 + 4 / 128}[mode]
    assert mlp.experts("w13").nbytes + mlp.experts("w2").nbytes == e * 3 * d * f * per_weight
    qkv = loaded.model.layers[0].self_attn.qkv_proj.kernel[...]
    assert qkv.dtype == (jnp.float32 if mode == "mxfp4" else kernel_dtype)
    _, logits = run_mixed_schedule(loaded, [[1, 2, 3, 4, 5], [7, 8]])
    assert all(np.isfinite(v).all() for v in logits.values())


def test_packed_formats_are_for_dummy_weights(tmp_path):
    """-q int4 / fp8_block on a checkpoint (whose own format is read from it) is refused."""
    path = make_tiny_hf("qwen3_moe", tmp_path, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="'int4' makes random packed weights for --load-format"):
        load_model(path, quantization="int4")


def test_start_up_logs_weight_bytes_by_class(caplog):
    caplog.set_level("INFO", logger="jaxserve.models.loader")
    load_model(
        "gpt-oss-20b",
        load_format="dummy",
        quantization="mxfp4",
        dtype="float32",
        hf_overrides=SMALL["gpt-oss-20b"],
    )
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: "))
    assert "mxfp4 experts " in line and "mxfp4 experts (scales) " in line and "the rest " in line


def test_engine_loads_gpt_oss_dummy_experts_packed(monkeypatch):
    """`-q mxfp4 --load-format dummy` reaches the engine core's load (its experts alone)."""
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(
        "gpt-oss-20b",
        load_format="dummy",
        quantization="mxfp4",
        dtype="float32",
        hf_overrides=SMALL["gpt-oss-20b"],
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=16,
    )
    mlp = runner_of(llm).model.layers[0].mlp
    assert mlp.w13[...].dtype == jnp.uint8 and mlp.w13_scale[...].dtype == jnp.uint8
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
