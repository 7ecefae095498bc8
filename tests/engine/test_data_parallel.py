"""Data parallelism: several engine core processes behind one frontend, a DP coordinator, and
the load balancer; tiny random-weight models, one XLA CPU device per engine."""

import asyncio
import os
import signal
import time

import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.coordinator import DPCoordinator
from jaxserve.engine.core_client import combine_results
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.engine.launch import device_env
from jaxserve.engine.load_balancer import LoadBalancer
from jaxserve.entrypoints.llm import LLM
from jaxserve.ipc.messages import DPEngineState, DPWave
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_adapter, make_tiny_hf

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              num_gpu_blocks_override=64)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [{"prompt_token_ids": [1 + i % 50, 2, 3 + i % 7, 4]} for i in range(64)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny")))


def engine_states(state: dict) -> list[dict]:
    return state["engines"]


# ---------------------------------------------------------------------- pieces, no processes
def test_coordinator_starts_a_wave_on_work_and_ends_it_when_all_are_idle():
    c = DPCoordinator(2)
    assert c.update(DPEngineState(0, 1, 0, start_wave=True)) == DPWave(0, running=True)
    assert c.update(DPEngineState(0, 0, 1)) is None and c.engines_running
    assert c.update(DPEngineState(1, 0, 0)) is None  # engine 0 still has work
    assert c.update(DPEngineState(0, 0, 0)) == DPWave(1, running=False)  # all idle: wave 1
    assert c.all_idle() and c.load_state().counts == [[0, 0], [0, 0]]
    # a start_wave while one runs changes nothing; the counts it carries still count
    c.update(DPEngineState(1, 2, 0, start_wave=True))
    assert c.update(DPEngineState(0, 1, 0, start_wave=True)) is None
    assert c.load_state().counts == [[1, 0], [2, 0]] and c.load_state().wave == 1


def test_load_balancer_scores_waiting_4x_and_counts_its_own_picks():
    lb = LoadBalancer("ipc:///nonexistent", 3, client_index=0, client_count=1)
    try:
        lb.counts = [[1, 0], [0, 3], [0, 5]]  # scores 4, 3, 5
        assert lb.pick() == 1
        assert lb.counts[1] == [1, 3]  # now 7: engine 0 (4) next
        assert [lb.pick() for _ in range(3)] == [0, 2, 1]  # 4 -> 8, 5 -> 9, 7 -> 11
        lb.counts = [[0, 0], [0, 0], [0, 0]]
        assert lb.pick(num_requests=2) == 0 and lb.counts[0] == [2, 0]
        # ties go to the first engine from the client's index (API servers spread at once)
        other = LoadBalancer("ipc:///nonexistent", 3, client_index=2, client_count=2)
        assert other.pick() == 2 and other.counts[2] == [2, 0]  # bumped per API server
        other.stop()
    finally:
        lb.stop()


def test_utility_results_of_several_engines_combine():
    a = {"num_requests": 1, "num_free_blocks": 10, "shutting_down": False, "engine_index": 0}
    b = {"num_requests": 2, "num_free_blocks": 20, "shutting_down": True, "engine_index": 1}
    merged = combine_results([a, b])
    assert merged["num_requests"] == 3 and merged["num_free_blocks"] == 30
    assert merged["shutting_down"] and merged["engine_index"] == [0, 1]
    assert merged["engines"] == [a, b]
    assert combine_results([True, False]) is False and combine_results([a]) is a


def test_each_engine_gets_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_env(0, 1, 2) == {}
    assert device_env(1, 2, 2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert device_env(1, 4, 1) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ValueError, match="needs 6 GPUs; CUDA_VISIBLE_DEVICES='4,5,6,7' lists 4"):
        device_env(2, 3, 2)


# ---------------------------------------------------------------------- engines in processes
def test_dp2_spreads_requests_evenly_with_the_tokens_of_dp1(model_dir, tmp_path):
    """With a LoRA adapter on every third prompt: each engine loads it for its own requests."""
    adapter = LoRARequest("a", 1, str(make_tiny_adapter(model_dir, tmp_path / "a", r=4, seed=1)))
    loras = [adapter if i % 3 == 0 else None for i in range(len(PROMPTS))]
    engine = {**ENGINE, "enable_lora": True, "max_lora_rank": 4}
    llm = LLM(model_dir, data_parallel_size=2, **engine)
    try:
        client = llm.llm_engine.engine_core
        assert len(client.engines) == 2 and len(client.group.procs) == 2
        assert client.group.coordinator is not None
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
        ours = [o.outputs[0].token_ids for o in outs]
        assert client.call_utility("remove_lora", 1) is True  # on every engine
        state = client.call_utility("get_state")  # also runs check_no_leaks() in each core
        per_engine = [s["num_requests_added"] for s in engine_states(state)]
        assert sum(per_engine) == 64 and all(26 <= n <= 38 for n in per_engine), per_engine
        assert [s["engine_index"] for s in engine_states(state)] == [0, 1]
        assert state["num_requests"] == 0 and state["num_free_blocks"] == 2 * 63
        # n > 1 children go to one engine (they share the prompt's blocks)
        before = [s["num_requests_added"] for s in engine_states(state)]
        llm.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=4), use_tqdm=False)
        after = client.call_utility("get_state")
        now = [s["num_requests_added"] for s in engine_states(after)]
        added = [n - b for n, b in zip(now, before, strict=True)]
        assert sorted(added) == [0, 4], added
        _, request = llm.llm_engine.process_inputs("x", PROMPTS[0], GREEDY)
        request.data_parallel_rank = 2
        with pytest.raises(ValueError, match="data_parallel_rank 2 is out of range: there are 2"):
            client.add_request(request)
    finally:
        llm.llm_engine.shutdown()
    one = LLM(model_dir, **engine)
    try:
        outs = one.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
        assert ours == [o.outputs[0].token_ids for o in outs]
    finally:
        one.llm_engine.shutdown()


LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def start_async(model_dir, monkeypatch, step_delay: float = 0.03, **kw) -> AsyncLLM:
    """dp=2 AsyncLLM whose engines sleep step_delay per step (requests surely in flight)."""
    monkeypatch.setenv("JAXSERVE_TEST_STEP_DELAY_S", str(step_delay))
    return AsyncLLM.from_engine_args(
        EngineArgs(model=model_dir, data_parallel_size=2, **{**ENGINE, **kw})
    )


async def first_output(gen):
    return await asyncio.wait_for(gen.__anext__(), 60)


async def wait_for_state(llm, check, within: float = 10.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        state = await llm.call_utility("get_state")
        if check(engine_states(state)) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


def test_an_abort_frees_its_engines_blocks_and_a_killed_engine_fails_every_request(
    model_dir, monkeypatch
):
    """One dp=2 AsyncLLM: an abort frees the blocks of the engine holding the request only;
    then one engine is killed, and every request (on either engine) fails at once."""

    async def main():
        llm = start_async(model_dir, monkeypatch)
        try:
            await abort_frees_the_blocks_of_its_engine(llm)
            await a_killed_engine_fails_every_request_fast(llm)
        finally:
            llm.shutdown()
        for proc in llm.engine_core.group.procs:  # the other engine is stopped too
            assert proc.poll() is not None

    asyncio.run(main())


async def abort_frees_the_blocks_of_its_engine(llm: AsyncLLM) -> None:
    a = llm.generate(PROMPTS[0], LONG, "a", data_parallel_rank=0)
    b = llm.generate(PROMPTS[1], LONG, "b", data_parallel_rank=1)
    await first_output(a)
    await first_output(b)
    state = await llm.call_utility("get_state")
    assert [s["num_requests"] for s in engine_states(state)] == [1, 1]
    await a.aclose()  # the consumer goes away: "a" is aborted in engine 0 only
    state = await wait_for_state(llm, lambda e: e[0]["num_requests"] == 0)
    e0, e1 = engine_states(state)
    assert e0["num_requests"] == 0 and e0["num_free_blocks"] == e0["num_blocks"] - 1
    assert e1["num_requests"] == 1 and e1["num_free_blocks"] < e1["num_blocks"] - 1
    outs = [out async for out in b]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 100
    state = await wait_for_state(llm, lambda e: e[1]["num_requests"] == 0)
    assert state["num_free_blocks"] == 2 * 63  # and check_no_leaks() ran in each core
    lb = llm.engine_core.load_balancer
    deadline = time.monotonic() + 5
    while not lb.all_idle() and time.monotonic() < deadline:  # the coordinator knows
        await asyncio.sleep(0.05)
    assert lb.all_idle() and lb.wave >= 1


async def a_killed_engine_fails_every_request_fast(llm: AsyncLLM) -> None:
    gens = [llm.generate(PROMPTS[i], LONG, f"r{i}") for i in range(6)]
    for gen in gens:
        await first_output(gen)
    state = await llm.call_utility("get_state")
    assert all(s["num_requests"] > 0 for s in engine_states(state))  # both serve
    os.kill(llm.engine_core.group.procs[1].pid, signal.SIGKILL)
    start = time.monotonic()

    async def drain(gen):
        async for _ in gen:
            pass

    results = await asyncio.wait_for(
        asyncio.gather(*(drain(g) for g in gens), return_exceptions=True), 10
    )
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert time.monotonic() - start < 3
    assert "engine 1's process exited with code -9" in str(results[0])
    with pytest.raises(EngineDeadError):
        await first_output(llm.generate(PROMPTS[0], GREEDY, "late"))


def test_moe_engines_step_together_while_any_has_work(tmp_path, monkeypatch):
    """Waves: while engine 0 runs a request, idle engine 1 runs dummy steps (a mixture of
    experts' engines would meet in collectives); once all are idle, the wave ends and the
    dummy steps stop."""
    moe = str(make_tiny_hf("mixtral", tmp_path))

    async def main():
        llm = start_async(moe, monkeypatch, step_delay=0.02)
        try:
            state = await llm.call_utility("get_state")
            assert [s["num_dummy_steps"] for s in engine_states(state)] == [0, 0]
            gen = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True),
                               "moe", data_parallel_rank=0)  # fmt: skip
            assert [out async for out in gen][-1].finished
            lb = llm.engine_core.load_balancer
            deadline = time.monotonic() + 5
            while not lb.all_idle() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert lb.all_idle() and lb.wave >= 1
            e0, e1 = engine_states(await llm.call_utility("get_state"))
            # engine 0 runs a few after its request, until the wave's end reaches it (4 under a
            # loaded CI machine): few against idle engine 1's, one per step of the request
            assert e1["num_dummy_steps"] >= 10, (e0, e1)
            assert e0["num_dummy_steps"] * 4 <= e1["num_dummy_steps"], (e0, e1)
            await asyncio.sleep(0.5)
            later = engine_states(await llm.call_utility("get_state"))[1]["num_dummy_steps"]
            assert later == e1["num_dummy_steps"]  # the wave ended: no more dummy steps
        finally:
            llm.shutdown()

    asyncio.run(main())
