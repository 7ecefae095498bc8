"""Qwen3-Next, a hybrid model: gated delta-net layers keep a state per request (its
input-batch row), full-attention layers paged KV blocks. Logits equal HF's; through the whole
engine (chunked prefill, preemption, tp 2) greedy tokens and logprobs equal HF generate's,
rows reused by later requests start from zeros, nothing compiles while serving, the cache
holds K/V for the attention layers only, and what a per-request state cannot honour
(speculative decoding, KV transfer) is refused by name."""

import jax
import numpy as np
import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.entrypoints.llm import LLM
from jaxserve.models.loader import load_model
from jaxserve.worker.executables import num_compilations
from jaxserve.worker.kv_cache import determine_num_blocks
from tests.helpers import (
    assert_generate_matches_hf,
    core_of,
    hf_logits,
    hf_model,
    make_tiny_hf,
    runner_of,
)
from tests.models.test_llama_parity import run_mixed_schedule

# Qwen3-Next's shape scaled down: linear, full, linear layers; 2 key heads of 16 serving 4
# value heads of 8, a width-4 convolution; gated attention with q/k norms and half the head
# rotary; 8 experts (top 2) with a gated shared expert, layer 1 dense.
QWEN3_NEXT = dict(
    num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), **QWEN3_NEXT)


def test_logits_match_hf(model_dir):
    """Prompts prefilled whole and in two chunks (the second continuing the first's state)
    beside single-token decodes: every position's logits within 1e-4 of HF's (fp32)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5, 17)]
    fed, logits = run_mixed_schedule(load_model(str(model_dir), dtype="float32"), prompts)
    ref = hf_model(str(model_dir))
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_matches_hf_through_reused_rows_and_preemption(model_dir, tp, monkeypatch):
    """Six requests through two input-batch rows, prefilled in 16-token chunks (each
    continuing its row's state) and preempted by a 4-block pool: rows taken over by later
    requests, and requests recomputed after preemption, start from zeros. HF's tokens, at tp
    1 and 2 (the gated attention's heads split, and the linear layers' weights and states by
    key heads), no compilation while serving, no blocks leaked."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(model_dir), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=96,
              dtype="float32", num_gpu_blocks_override=5, tensor_parallel_size=tp)  # fmt: skip
    runner = runner_of(llm)
    k, v, conv, rec = runner.kv_caches
    assert k.shape[0] == runner.num_blocks  # one attention layer's blocks
    # each linear layer's own state arrays: a row per input-batch row, then as many kept
    # for prefix-cache hits (core/state_cache.py)
    assert [c.shape for c in conv] == [(2 + 2, 3, 2 * 2 * 16 + 4 * 8)] * 2
    assert [r.shape for r in rec] == [(2 + 2, 4, 16, 8)] * 2
    assert_linear_layers_split(runner, tp)
    # no LAPACK custom call (jax.scipy's triangular solve): loaded from the executable cache
    # in a fresh process, where no trace registered it, one segfaulted
    forwards = [c.as_text() for key, c in runner.executables.items() if key[0] == "forward"]
    assert forwards and not any("lapack" in text for text in forwards)
    compiled = num_compilations()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 19, 11, 7, 30, 13)]
    assert_generate_matches_hf(llm, model_dir, prompts, max_tokens=12)
    assert num_compilations() == compiled
    scheduler = core_of(llm).scheduler
    assert scheduler.total_preemptions > 0
    scheduler.kv_cache_manager.check_no_leaks()


def assert_linear_layers_split(runner, tp: int) -> None:
    """At tp > 1 every device holds 1 / tp of a linear layer's weights and states."""
    la = runner.model.layers[0].linear_attn
    _, _, conv, rec = runner.kv_caches
    arrays = (la.in_proj_qkvz.kernel[...], la.in_proj_ba.kernel[...], la.conv1d[...],
              la.A_log[...], la.out_proj.kernel[...], conv[0], rec[0])  # fmt: skip
    for x in arrays:
        shard = x.addressable_shards[0].data
        assert shard.size * tp == x.size, (x.shape, x.sharding)


def test_what_a_per_request_state_cannot_honour(model_dir):
    """Prefix caching keeps a state slot per sequence (tested in test_hybrid_prefix_cache.py);
    KV transfer and speculative decoding are refused by name."""
    config = EngineArgs(model=str(model_dir), max_num_seqs=8).create_engine_config()
    assert config.cache.enable_prefix_caching and config.cache.state_cache_slots == 8
    off = EngineArgs(model=str(model_dir), enable_prefix_caching=False).create_engine_config()
    assert off.cache.state_cache_slots == 0
    assert config.model.kv_layers == (1,)
    with pytest.raises(ValueError, match=r"\(Qwen3NextForCausalLM\): kv_transfer_config: a hybrid"):
        EngineArgs(model=str(model_dir), kv_offloading_size=1).create_engine_config()
    # the states come off the KV budget: one too small says so
    small = EngineArgs(model=str(model_dir), kv_cache_memory_bytes=2**21).create_engine_config()
    with pytest.raises(ValueError, match="after 3 MiB of linear-attention states .*max_num_seqs"):
        determine_num_blocks(small.cache, jax.devices()[0], 4096, 9, 128, reserved_bytes=3 << 20)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match=r"\(Qwen3NextForCausalLM\): speculative_config: a hybrid"):
        EngineArgs(model=str(model_dir), speculative_config=spec).create_engine_config()
