"""Prefix caching for hybrid models (core/state_cache.py, worker/state_slots.py): a repeated
~2k-token prefix on tiny Qwen3-Next and Qwen3.5 models hits (cached tokens reported) and
gives a cold run's tokens and logprobs (HF generate's, run from scratch); the prefill is split
at the state boundary; the next turn of a chat hits at the previous turn's boundary; a reset
prefix cache forgets the states too."""

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import assert_generate_matches_hf, core_of, make_tiny_hf
from tests.models.test_qwen3_5 import SHAPE
from tests.models.test_qwen3_next import QWEN3_NEXT

GREEDY = SamplingParams(temperature=0, max_tokens=2)
ENGINE = dict(max_model_len=2304, max_num_seqs=2, max_num_batched_tokens=512, dtype="float32")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    shape = QWEN3_NEXT if request.param == "qwen3_next" else SHAPE
    shape = {**shape, "max_position_embeddings": 4096}
    return make_tiny_hf(request.param, tmp_path_factory.mktemp(request.param), **shape)


def test_a_repeated_prefix_hits_and_equals_a_cold_run(model_dir, monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, 256, 2000).tolist()  # boundary 2000: inside a 512-token chunk
    first, second = prefix + [5, 6, 7, 8, 9], prefix + [11, 12, 13]
    chat = first + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]
    llm = LLM(str(model_dir), **ENGINE)
    scheduler = core_of(llm).scheduler
    hits, make = [], scheduler.make_stats

    def counting():  # every step's stats (each call resets the counts)
        stats = make()
        hits.append(stats.prefix_cache_hits)
        return stats

    scheduler.make_stats = counting
    cached = []
    for prompt in (first, second, chat):  # one after another: each later one hits
        (out,) = assert_generate_matches_hf(llm, model_dir, [prompt], max_tokens=6)
        cached.append(out.num_cached_tokens)
    # the first computes all; the second restores the state at 2000 (its own boundary too);
    # the chat's next turn hits there as well (its boundary, 2016, is saved then)
    assert cached == [0, 2000, 2000]
    # the prefix cache's hits as /metrics counts them: the tokens each request took
    assert sum(hits) == 4000
    scheduler.kv_cache_manager.check_no_leaks()
    assert llm.llm_engine.engine_core.call_utility("reset_prefix_cache")
    (out,) = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0  # states forgotten with the blocks
