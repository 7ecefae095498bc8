"""The engine core's batch queue with pipeline parallelism (engine/core.py): up to
pipeline_parallel_size micro-batches in flight, each request in at most one of them, over the
simulated runner's stages (worker/simulated.py); and what pp refuses."""

from __future__ import annotations

import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

ARGS = dict(model="llama-3.2-1b", load_format="dummy", max_model_len=256, max_num_seqs=16,
            max_num_batched_tokens=256, num_gpu_blocks_override=256)  # fmt: skip


def _engine(monkeypatch, pp: int, **extra) -> LLMEngine:
    monkeypatch.setenv("JAXSERVE_SIMULATED_STEP", "4,0")  # 4 ms a step: 4 / pp per stage
    return LLMEngine.from_engine_args(
        EngineArgs(pipeline_parallel_size=pp, **ARGS, **extra), multiprocess=False
    )


@pytest.mark.parametrize("pp", [2, 4])
def test_pp_micro_batches_in_flight_each_request_in_one(monkeypatch, pp):
    engine = _engine(monkeypatch, pp)
    core = engine.engine_core.engine_core
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(16):
        engine.add_request(str(i), {"prompt_token_ids": [1 + i, 2, 3, 4, 5]}, params)
    finished, in_flight = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        in_flight.append(engine.scheduler_stats.num_batches_in_flight)
        scheduled = [set(so.num_scheduled_tokens) for so, _ in core.in_flight]
        ids = [r for s in scheduled for r in s]
        assert len(ids) == len(set(ids)), scheduled  # no request in two micro-batches
    assert sorted(finished, key=int) == [str(i) for i in range(16)]
    assert all(len(o.outputs[0].token_ids) == 24 for o in finished.values())
    # the queue fills to pp during decode and never beyond
    assert max(in_flight) == pp and in_flight.count(pp) > len(in_flight) // 2
    assert core.get_state()["num_free_blocks"] == 255  # every block back
    engine.shutdown()


def test_pp_1_keeps_one_or_two_steps_in_flight(monkeypatch):
    for async_scheduling, depth in ((False, 1), (True, 2)):
        engine = _engine(monkeypatch, 1, async_scheduling=async_scheduling)
        assert engine.engine_core.engine_core.max_in_flight == depth
        engine.shutdown()


def test_what_pp_refuses(monkeypatch):
    with pytest.raises(ValueError, match="speculative_config is not supported"):
        EngineArgs(pipeline_parallel_size=2, speculative_config={"method": "ngram",
                   "num_speculative_tokens": 2}, **ARGS).create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(pipeline_parallel_size=2, async_scheduling=True, **ARGS).create_engine_config()
    with pytest.raises(ValueError, match="exceeds the model's 16 layers"):
        EngineArgs(pipeline_parallel_size=17, **ARGS).create_engine_config()
    # the first refused pair (config/compat.py's table; tests/config/test_compat.py: each)
    with pytest.raises(ValueError, match=r"with LoRA \(enable_lora\): .* not supported yet with"):
        EngineArgs(pipeline_parallel_size=2, enable_lora=True, enable_sleep_mode=True,
                   **ARGS).create_engine_config()  # fmt: skip
    # over several hosts each host holds whole stages or each stage spans whole hosts
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 over nnodes=2: each host"):
        EngineArgs(pipeline_parallel_size=3, nnodes=2, **ARGS).create_engine_config()
