"""Through the whole engine (scheduler, chunked prefill, runner, sampler), for every model
family: greedy tokens of a tiny random model equal HF `generate` over 32 steps and logprobs
agree within 1e-2, at tp 1, and at tp 2 (host devices) for each distinct split. Prompts of 9,
23 and 14 tokens: the 23-token one is prefilled in two chunks (16-token budget), all run
past the 6-token sliding windows of the windowed families, and a small KV pool preempts
them."""

import numpy as np
import pytest

from jaxserve.config.kv_groups import kv_cache_layout
from jaxserve.entrypoints.llm import LLM
from jaxserve.transformers_utils.config import read_model_config
from tests.helpers import (
    assert_generate_matches_hf,
    assert_offload_round_trip,
    core_of,
    make_tiny_hf,
)
from tests.models.test_llama_parity import FAMILIES as DENSE
from tests.models.test_moe import FAMILIES as MOE

GENERATE = {  # one configuration per family, the parity test's
    "llama": DENSE["llama3-rope-tied"],
    "mistral": DENSE["mistral-sliding-window"],
    "qwen2": DENSE["qwen2-bias"],
    "qwen3": DENSE["qwen3-qk-norm"],
    "phi3": DENSE["phi3-fused"],
    "gemma2": DENSE["gemma2"],
    "gemma3": DENSE["gemma3"],
    "gemma4": DENSE["gemma4"],
    "mixtral": ("mixtral", MOE["mixtral"]),
    "qwen3_moe": ("qwen3_moe", MOE["qwen3_moe"]),
    "glm4_moe": ("glm4_moe", MOE["glm4_moe"]),
    "deepseek_v3": ("deepseek_v3", MOE["deepseek_v3"]),
    "deepseek_v2": ("deepseek_v2", MOE["deepseek_v2"]),
    "gpt_oss": ("gpt_oss", MOE["gpt_oss"]),
    "llama4": ("llama4", MOE["llama4"]),
}
# Qwen3-Next (a hybrid: linear-attention states per request) is run the same way, at tp 1
# and 2, in test_qwen3_next.py.
# 7 usable KV blocks of 16 for prompts of 9, 23 and 14 tokens and 32 new tokens each (10
# blocks at once): requests are preempted and recomputed, prefix caching on.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32",
              num_gpu_blocks_override=8)  # fmt: skip


def pool_blocks(model_dir) -> int:
    """The KV pool: ENGINE's, or with KV-cache groups (windowed and full layers:
    config/kv_groups.py) 4 blocks a group and 2: one request fits (4 blocks in the full
    group, at most 3 in a windowed one), three at once do not (they are preempted)."""
    groups = kv_cache_layout(read_model_config(model_dir, "float32")).num_groups
    return ENGINE["num_gpu_blocks_override"] if groups == 1 else 4 * groups + 2


# tp 2 through the whole engine for llama (the dense families split alike: sliding windows,
# softcaps and q/k norms split no differently) and for the experts of Qwen3-MoE (Mixtral's
# are the same MoE layer, split alike); the dense families' own splits (qwen2's qkv bias,
# phi3's fused checkpoint, qwen3, gemma3) are compared at tp 1, 2 and 4 in
# tests/distributed/test_tensor_parallel.py.
# Gemma 4 at tp 2: its full layers' one KV head repeated to fill each device's cache row.
# DeepSeek at tp 2 (MLA's heads split, the latent replicated on each rank) against HF:
# test_moe.py's offloading test.
TP2 = ("llama", "qwen3_moe", "gemma4")
CASES = [(family, 1) for family in sorted(GENERATE)] + [(family, 2) for family in TP2]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> its tiny random HF model's directory, made once for the module."""
    made = {}

    def get(family: str):
        if family not in made:
            name, overrides = GENERATE[family]
            made[family] = make_tiny_hf(name, tmp_path_factory.mktemp(family), **overrides)
        return made[family]

    return get


@pytest.mark.parametrize(("family", "tp"), CASES)
def test_greedy_generate_matches_hf(family_dirs, family, tp, monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    family_dir = family_dirs(family)
    blocks = pool_blocks(family_dir)
    llm = LLM(
        str(family_dir), tensor_parallel_size=tp, **{**ENGINE, "num_gpu_blocks_override": blocks}
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 23, 14)]
    assert_generate_matches_hf(llm, family_dir, prompts)
    scheduler = core_of(llm).scheduler
    # Mistral's window gives back the blocks behind it: its requests fit
    assert scheduler.total_preemptions > 0 or family == "mistral"
    scheduler.kv_cache_manager.check_no_leaks()


def test_mistral_sliding_window_gives_back_blocks(tmp_path, monkeypatch):
    """Every layer windowed (8 keys, blocks of 4): greedy tokens and logprobs equal HF
    generate's past the window, and no request holds more than the window's blocks plus the
    ones being written (the KV manager gives the rest back as it runs). 13 usable blocks for
    two requests of 37 and 53 tokens: given-back blocks are reused by the other request while
    the runner's block table still names them, outside the window."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = make_tiny_hf("mistral", tmp_path, head_dim=16, sliding_window=8)
    llm = LLM(str(model_dir), block_size=4, **{**ENGINE, "num_gpu_blocks_override": 14})
    engine = llm.llm_engine
    kv = engine.engine_core.engine_core.scheduler.kv_cache_manager
    assert [(g.kind, g.span) for g in kv.groups] == [("sliding", 8)]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 21)]  # 21: chunked (16)
    most_held = 0
    step = engine.step

    def watched_step():
        nonlocal most_held
        outs = step()
        for (blocks,) in kv.req_to_blocks.values():
            most_held = max(most_held, sum(not b.is_null for b in blocks))
        return outs

    engine.step = watched_step
    assert_generate_matches_hf(llm, model_dir, prompts)
    assert most_held <= 8 // 4 + 16 // 4 + 1  # window + a 16-token chunk (+ a partial block)
    assert engine.engine_core.engine_core.scheduler.total_preemptions == 0
    kv.check_no_leaks()


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "gemma4"])
def test_windowed_groups_serve_a_prefix_hit(family_dirs, family, monkeypatch):
    """A model with KV-cache groups (full and sliding-window layers: config/kv_groups.py)
    run twice on one 40-token prompt: the second run hits its first two blocks (32 tokens:
    every full-attention block, and of the windowed groups' only the block the next token's
    window reads) and still gives HF's tokens and logprobs."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    family_dir = family_dirs(family)
    llm = LLM(str(family_dir), **{**ENGINE, "num_gpu_blocks_override": 64})
    kv = core_of(llm).scheduler.kv_cache_manager
    assert {g.kind for g in kv.groups} == {"full", "sliding"}
    prompt = np.random.default_rng(2).integers(1, 256, 40).tolist()
    (cold,) = assert_generate_matches_hf(llm, family_dir, [prompt])
    (warm,) = assert_generate_matches_hf(llm, family_dir, [prompt])
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 32)
    kv.check_no_leaks()


@pytest.mark.parametrize("family", ["gemma2", "gemma4"])
def test_grouped_blocks_offload_and_come_back(family_dirs, family, monkeypatch):
    """With the host offload tier, a model's KV-cache groups stay (Gemma 2: a full and two
    sliding groups of one layer; Gemma 4: a full group of two layers packed in one slot and
    two sliding ones, its KV-sharing layers holding none): a block position moves with its
    block of every group, and a prompt's blocks evicted from the device come back from the
    host as a prefix hit with HF's tokens."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = family_dirs(family)
    llm = LLM(str(model_dir), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=160,
              dtype="float32", num_gpu_blocks_override=40, kv_offloading_size=0.01)  # fmt: skip
    core = core_of(llm)
    groups = len(core.scheduler.kv_cache_manager.groups)
    assert (groups, core.runner.kv.block_shape[0]) == {"gemma2": (3, 3), "gemma4": (3, 3)}[family]
    assert_offload_round_trip(llm, model_dir)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        {"method": "draft_model", "num_speculative_tokens": 2},
    ],
)
def test_gemma4_speculative_decoding_equals_hf(family_dirs, spec, monkeypatch):
    """Gemma 4 verifying drafts (ngram's, a Gemma 4 draft model's: its own cache of its cached
    layers only) gives HF generate's greedy tokens and logprobs."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = family_dirs("gemma4")
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(model_dir)}
    llm = LLM(str(model_dir), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
              dtype="float32", speculative_config=spec)  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 23, 14)]
    prompts[0] *= 3  # a repeated prompt ngram finds drafts in
    assert_generate_matches_hf(llm, model_dir, prompts)
    core_of(llm).scheduler.kv_cache_manager.check_no_leaks()
