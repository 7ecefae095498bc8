"""Sleep / wake and weight updates without a restart (engine/core_control.py,
worker/device_state.py), with the engine core in the test's process: outputs against HF on the
same weights, device memory as live-array bytes, buffer identity for the zero-copy update, and
no step compiled after start-up."""

from __future__ import annotations

import asyncio

import httpx
import jax
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import EngineAsleepError
from jaxserve.entrypoints.llm import LLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.models.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.executables import num_compilations
from tests.engine.test_kv_transfer_params import FakeCore, config
from tests.helpers import assert_generate_matches_hf, engines_in_process, hf_model, make_tiny_hf

PROMPTS = [[1, 5, 9, 42, 7], [3, 100, 4]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas of one config: A (the engine's) and B (A's weights moved)."""
    a = make_tiny_hf("llama", tmp_path_factory.mktemp("a"))
    b = tmp_path_factory.mktemp("b")
    model = hf_model(str(a))
    torch.manual_seed(1)
    moved = type(model)(model.config)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), moved.named_parameters(), strict=True):
            q.copy_(p + 0.05 * torch.randn_like(p))
    moved.save_pretrained(b)
    return a, b


@pytest.fixture(scope="module")
def llm(models):
    with engines_in_process():
        engine = LLM(str(models[0]), enable_sleep_mode=True, max_model_len=128, max_num_seqs=4,
                     max_num_batched_tokens=64)  # fmt: skip
        yield engine
        engine.llm_engine.shutdown()


def _ids(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _buffers(runner) -> list[int]:
    """collective_rpc's function: each parameter's device buffer."""
    return [x.unsafe_buffer_pointer() for x in runner.params]


def _hf_state(model_dir) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in hf_model(str(model_dir)).state_dict().items()}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_weights_and_kv_cache_and_wake_up_gives_the_same_output(llm, level):
    want = _ids(llm)
    compiled = num_compilations()
    before = _live_bytes()
    llm.sleep(level)
    asleep = _live_bytes()
    assert llm.is_sleeping()
    # every weight and KV block went: what is left is the sampler's state and the like
    layout = llm.weight_layout()
    weights = sum(np.prod(s) * np.dtype(d).itemsize for s, d in layout.values())
    assert before - asleep >= weights, (before, asleep, weights)
    (failed,) = llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"  # that request alone, with the reason
    assert "asleep" in str(failed.outputs[0].stop_reason)
    llm.wake_up(tags=["weights"])  # one at a time (vLLM's tags)
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping() and abs(_live_bytes() - before) < 0.05 * before
    assert _ids(llm) == want
    print(f"sleep level {level}: live bytes {before} -> {asleep} -> {_live_bytes()}")
    # no step shape compiled again (waking zero-fills the KV cache: one small program)
    assert num_compilations() - compiled <= 2


def test_update_weights_by_hf_names_equals_hf_on_the_new_weights(llm, models):
    a, b = models
    _ids(llm)
    compiled = num_compilations()
    counts = llm.update_weights(_hf_state(b))
    assert counts["copied"] == len(llm.weight_layout()) and counts["adopted"] == 0
    assert_generate_matches_hf(llm, b, PROMPTS, max_tokens=8)
    assert num_compilations() == compiled  # new weights, the same executables
    llm.update_weights(_hf_state(a))  # back
    assert_generate_matches_hf(llm, a, PROMPTS, max_tokens=8)


def test_update_weights_in_the_engines_layout_adopts_the_arrays_without_a_copy(llm, models):
    a, b = models
    trainer = load_model(str(b), load_tokenizer=False)  # a JAX trainer's model: our layout
    state = nnx.state(trainer.model)
    arrays = [x for x in jax.tree.leaves(state)]
    compiled = num_compilations()
    counts = llm.update_weights(state)
    assert counts == {"adopted": len(arrays), "copied": 0}
    # the engine holds the trainer's own device buffers
    assert sorted(llm.collective_rpc(_buffers)[0]) == sorted(
        x.unsafe_buffer_pointer() for x in arrays
    )
    assert_generate_matches_hf(llm, b, PROMPTS, max_tokens=8)
    assert num_compilations() == compiled
    llm.update_weights(_hf_state(a))


def test_bad_updates_are_refused_naming_the_weight_and_change_nothing(llm, models):
    want = _ids(llm)
    state = _hf_state(models[1])
    with pytest.raises(ValueError, match=r"k_proj.weight, .*v_proj.weight missing"):
        llm.update_weights({"model.layers.0.self_attn.q_proj.weight": state[
            "model.layers.0.self_attn.q_proj.weight"]})  # fmt: skip
    with pytest.raises(ValueError, match="unknown weight names.*model.nope"):
        llm.update_weights({**state, "model.nope": np.zeros(3, np.float32)})
    name, (shape, _) = next(iter(llm.weight_layout().items()))
    with pytest.raises(ValueError, match=f"{name} has shape"):
        llm.update_weights({name: np.zeros((*shape, 2), np.float32)})
    assert _ids(llm) == want


def test_reload_weights_from_a_checkpoint_directory(llm, models):
    a, b = models
    llm.reload_weights(str(b))
    assert_generate_matches_hf(llm, b, PROMPTS, max_tokens=8)
    llm.reload_weights()  # the model's own
    assert_generate_matches_hf(llm, a, PROMPTS, max_tokens=8)


def test_sleep_needs_sleep_mode(models):
    with engines_in_process():
        engine = LLM(str(models[0]), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            engine.sleep(1)
        engine.llm_engine.shutdown()


# ---------------------------------------------------------------------- AsyncLLM, the server
class SleepyCore(FakeCore):
    """A stand-in core that sleeps and wakes as the real one answers its utility calls (each
    request finishes at once with one token); `can_sleep` False: sleep is refused, as
    without enable_sleep_mode."""

    asleep = False
    can_sleep = True

    async def call_utility_async(self, method: str, *args):
        if method == "sleep":
            if not self.can_sleep:
                raise RuntimeError("ValueError: sleep needs enable_sleep_mode=True")
            self.asleep = True
        elif method == "wake_up":
            self.asleep = args[0] == ["weights"]  # the KV cache still asleep
        return self.asleep if method == "is_sleeping" else True


async def _tokens(engine: AsyncLLM, request_id: str) -> list[int]:
    """The request's tokens; a hang (what a request to a sleeping engine did) fails the test."""

    async def run():
        return [t async for o in engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(
            max_tokens=1), request_id) for t in o.outputs[0].token_ids]  # fmt: skip

    return await asyncio.wait_for(run(), 60)


def test_a_request_to_a_sleeping_engine_fails_at_once_and_runs_after_wake_up():
    async def main():
        core = SleepyCore()
        engine = AsyncLLM(config(), core)
        await engine.pause_generation("keep")
        paused = asyncio.create_task(_tokens(engine, "paused"))  # waits for resume
        await asyncio.sleep(0)
        await engine.sleep(1)
        with pytest.raises(EngineAsleepError, match="the engine is asleep"):
            await paused  # a waiting request fails as the engine falls asleep
        with pytest.raises(EngineAsleepError):
            await _tokens(engine, "asleep")
        await engine.wake_up(["weights"])
        with pytest.raises(EngineAsleepError):
            await _tokens(engine, "half-awake")
        await engine.wake_up()
        assert await engine.is_paused()  # paused before it slept: paused still
        await engine.resume_generation()
        assert await _tokens(engine, "awake") == [7]
        await engine.sleep(2)  # not paused before: wake_up resumes
        await engine.wake_up()
        assert await _tokens(engine, "again") == [7]
        core.can_sleep = False  # a refused sleep leaves the engine serving
        with pytest.raises(RuntimeError, match="enable_sleep_mode"):
            await engine.sleep(1)
        assert await _tokens(engine, "not-asleep") == [7]
        engine.shutdown()

    asyncio.run(main())


def test_the_server_answers_503_to_a_request_while_asleep():
    engine = AsyncLLM(config(), SleepyCore(), tokenizer=None)
    app = build_app(engine, ["m"], log_stats_interval=None)
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 1}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await engine.sleep(1)
            asleep = [await client.post("/v1/completions", json={**body, "stream": s})
                      for s in (False, True)]  # fmt: skip
            await engine.wake_up()
            return asleep, await client.post("/v1/completions", json=body)

    try:
        (whole, streamed), awake = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)
    assert whole.status_code == 503 and "the engine is asleep" in whole.json()["error"]["message"]
    # a stream has begun: its one event is the error
    assert "the engine is asleep" in streamed.text and '"code":503' in streamed.text
    assert awake.status_code == 200, awake.text
