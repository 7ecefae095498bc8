"""Pipeline parallelism on the suite's 4 CPU devices (worker/pipeline_stages.py): greedy
tokens and logprobs equal to one stage's, for a tiny Llama, Gemma 3 and Qwen3-MoE at pp 2, pp 4
and tp 2 x pp 2; with chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import engines_in_process, make_tiny_hf, runner_of

PROMPTS = [[1, 5, 9, 42, 7, 3, 11], [3, 100, 4], [7] * 40, [200, 201, 202, 9, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


def run(model, prompts=PROMPTS, *, state: dict | None = None, **engine_args) -> list:
    """Greedy (tokens, logprobs) of each prompt, stepping the engine; state: filled with the
    core's get_state, the prompt tokens read from the prefix cache and the most micro-batches
    in flight."""
    llm = LLM(str(model), **{**ENGINE, **engine_args})
    engine = llm.llm_engine
    pp = engine_args.get("pipeline_parallel_size", 1)
    if pp > 1:  # each stage's weights and KV cache on devices of its own
        runner = runner_of(llm)
        stages = zip([s.params for s in runner.stages.stages], runner.kv_caches, strict=True)
        devices = [{d for x in [*p, *kv] for d in x.devices()} for p, kv in stages]
        assert len(devices) == pp and len(set().union(*devices)) == sum(map(len, devices))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    finished, in_flight = {}, 0
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        in_flight = max(in_flight, engine.scheduler_stats.num_batches_in_flight)
    core_state = engine.engine_core.call_utility("get_state")
    engine.shutdown()
    assert core_state["num_free_blocks"] == core_state["num_blocks"] - 1  # every block back
    outs = [finished[str(i)] for i in range(len(prompts))]
    if state is not None:
        cached = sum(o.num_cached_tokens for o in outs)
        state.update(core_state, cached_tokens=cached, max_in_flight=in_flight)
    results = []
    for o in outs:
        ids, logprobs = list(o.outputs[0].token_ids), o.outputs[0].logprobs
        results.append((ids, [lp[t].logprob for lp, t in zip(logprobs, ids, strict=True)]))
    return results


def assert_same(got, want):
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        np.testing.assert_allclose(lps, want_lps, atol=1e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    with engines_in_process():
        yield {
            "llama": make_tiny_hf("llama", root / "llama", num_hidden_layers=4),
            "gemma3": make_tiny_hf("gemma3", root / "gemma3", num_hidden_layers=4,
                                   sliding_window=8, head_dim=16),
            "qwen3_moe": make_tiny_hf("qwen3_moe", root / "moe", num_hidden_layers=4,
                                      num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32),
        }  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
def test_pp_equals_one_stage(models, family):
    want = run(models[family])
    assert_same(run(models[family], pipeline_parallel_size=2), want)
    if family == "llama":
        state = {}  # 4 requests over 4 stages: one each, every stage busy
        assert_same(run(models[family], state=state, pipeline_parallel_size=4), want)
        assert state["max_in_flight"] == 4
        assert_same(run(models[family], pipeline_parallel_size=2, tensor_parallel_size=2), want)


def test_pp_with_chunked_prefill_preemption_and_prefix_caching(models):
    prompts = [[7] * 40 + [i] for i in range(4)] + [[7] * 40 + [9]]  # a shared prefix
    tight = dict(max_num_batched_tokens=16, num_gpu_blocks_override=9)  # chunks, preemptions
    want, state = run(models["llama"], prompts), {}
    assert_same(run(models["llama"], prompts, state=state, pipeline_parallel_size=2, **tight), want)
    assert state["total_preemptions"] > 0
    assert state["cached_tokens"] > 0  # prompts' shared prefix read from the cache
