"""Qwen3.5, dense and MoE: Qwen3-Next's hybrid layout with the linear attention's projections
stored apart. Logits equal HF's (prefilled whole, in chunks, and decoded); through the engine
(chunked prefill, preemption, tp 2) greedy tokens and logprobs equal HF generate's; the
published ForConditionalGeneration checkpoints' language model loads from its own prefix."""

from pathlib import Path

import numpy as np
import pytest
import torch

from jaxserve.entrypoints.llm import LLM
from jaxserve.models.loader import load_model
from tests.helpers import (
    assert_generate_matches_hf,
    core_of,
    hf_logits,
    hf_model,
    make_tiny_hf,
    runner_of,
)
from tests.models.test_int4 import assert_generates_as_recorded, assert_matches_recorded
from tests.models.test_llama_parity import run_mixed_schedule
from tests.models.test_qwen3_next import assert_linear_layers_split

# Qwen3.5's shape scaled down: linear, full, linear layers; 2 key heads of 16 serving 4 value
# heads of 8, a width-4 convolution; gated attention with q/k norms, a quarter of each head
# rotary (its default); the MoE build's 8 experts (top 2) with a gated shared expert.
SHAPE = dict(
    num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        "dense": make_tiny_hf("qwen3_5", root / "dense", **SHAPE),
        "moe": make_tiny_hf("qwen3_5_moe", root / "moe", **SHAPE, **MOE),
    }


@pytest.mark.parametrize("build", ["dense", "moe"])
def test_logits_match_hf(models, build):
    """Prompts prefilled whole and in two chunks (the second continuing the first's state)
    beside single-token decodes: every position's logits within 1e-4 of HF's (fp32)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5, 17)]
    fed, logits = run_mixed_schedule(load_model(str(models[build]), dtype="float32"), prompts)
    ref = hf_model(str(models[build]))
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("build", "tp"), [("dense", 1), ("moe", 2)])
def test_generate_matches_hf_with_chunked_prefill_and_preemption(models, build, tp, monkeypatch):
    """Five requests through two input-batch rows, prefilled in 16-token chunks and preempted
    by a 5-block pool: HF's greedy tokens and logprobs (at tp 2 the linear layers' weights
    and states split by key heads), nothing leaked."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(models[build]), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=96,
              dtype="float32", num_gpu_blocks_override=5, tensor_parallel_size=tp)  # fmt: skip
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 19, 30, 7, 13)]
    assert_linear_layers_split(runner_of(llm), tp)
    assert_generate_matches_hf(llm, models[build], prompts, max_tokens=12)
    scheduler = core_of(llm).scheduler
    assert scheduler.total_preemptions > 0
    scheduler.kv_cache_manager.check_no_leaks()


def test_published_checkpoint_layout_serves_its_text_model(tmp_path, monkeypatch):
    """A Qwen3_5MoeForConditionalGeneration checkpoint (the language model under
    `model.language_model.`, a vision tower beside it): on text, the logits equal HF's for
    the whole model (images: test_qwen3_5_vl.py)."""
    import transformers

    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    from tests.helpers import TINY

    text = {**TINY, **SHAPE, **MOE}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, num_position_embeddings=16)  # fmt: skip
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(tmp_path)
    tokens = np.random.default_rng(2).integers(1, 256, 9).tolist()
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy()
    loaded = load_model(str(tmp_path), dtype="float32")
    fed, logits = run_mixed_schedule(loaded, [tokens], decode_steps=0)
    np.testing.assert_allclose(logits[0][: len(tokens)], want, atol=1e-4, rtol=0)


INT4 = Path(__file__).resolve().parents[1] / "data" / "quantized" / "ct-qwen3_5-moe-w4a16"


@pytest.mark.parametrize("tp", [1, 2])
def test_int4_checkpoint_stays_packed_and_matches_compressed_tensors(tp):
    """A W4A16 Qwen3.5-MoE (compressed-tensors' pack-quantized, a scale per 16 inputs;
    scripts/make_quantized_checkpoints.py qwen3_5): the linear attention's projections (its
    separate in_proj_qkv / z regrouped packed; in_proj_a / b in full precision), the
    attention's and every expert's stay int4, and the logits are transformers' of the layers
    as compressed-tensors decompresses them, within 1e-3 of their scale, at tp 1 and split by
    key heads at tp 2."""
    loaded = load_model(INT4, dtype="float32", tensor_parallel_size=tp)
    assert (loaded.config.quantization, loaded.config.expert_quant) == ("int4", "int4")
    linear = loaded.model.layers[0].linear_attn
    for proj in (linear.in_proj_qkvz, linear.out_proj):
        assert str(proj.kernel[...].dtype) == "uint8"
    assert str(loaded.model.layers[1].mlp.w13[...].dtype) == "uint8"
    assert_matches_recorded(loaded, INT4)


@pytest.mark.parametrize("tp", [1, 2])
def test_int4_checkpoint_generates_as_recorded_with_preemption(tp, monkeypatch):
    """The W4A16 Qwen3.5-MoE through the engine: prompts prefilled in 16-token chunks,
    preempted by a 5-block pool and recomputed, prefix caching on; greedy tokens equal and
    logprobs within 1e-2 of transformers' generate over the layers as compressed-tensors
    decompresses them (recorded: reference_generate.json, by
    scripts/make_quantized_checkpoints.py qwen3_5), at tp 1 and 2; nothing leaked."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(INT4), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=96,
              dtype="float32", num_gpu_blocks_override=5, tensor_parallel_size=tp)  # fmt: skip
    assert_generates_as_recorded(llm, INT4)
