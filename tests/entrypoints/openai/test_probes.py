"""The probes over HTTP (the app through httpx's ASGI transport): /health, /ping (GET and
POST), /ready and /ready?compiled=true before and after every step shape is compiled, and 503s
once the engine is dead. Over a stand-in engine core whose compile_status the test sets, and
over two real engine cores (dp=2) with the simulated runner, which start in a second and
answer the real utility call."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.core_client import combine_results
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.entrypoints.openai import probes
from jaxserve.entrypoints.openai.api_server import build_app
from tests.engine.test_kv_transfer_params import FakeCore, config

PARTLY = {"compiled": 23, "total": 100, "fully_compiled": False}
FULLY = {"compiled": 100, "total": 100, "fully_compiled": True}


class CompilingCore(FakeCore):
    """A stand-in core whose compile_status is `status`, counting the calls; `dead` set:
    the engine is dead."""

    def __init__(self):
        super().__init__()
        self.status, self.calls, self.delay = PARTLY, 0, 0.0

    async def call_utility_async(self, method: str, *args):
        assert method == "compile_status"
        self.calls += 1
        await asyncio.sleep(self.delay)
        if isinstance(self.status, Exception):
            raise self.status
        return self.status

    def poll_dead(self):
        return self.dead


@pytest.fixture
def stub():
    core = CompilingCore()
    app = build_app(AsyncLLM(config(), core, tokenizer=None), ["m"], log_stats_interval=None)
    yield app, core
    app.state.cpu.shutdown(wait=False)


async def probe(app, *requests: tuple[str, str]) -> list[httpx.Response]:
    """The requests (method, path), concurrently."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await asyncio.gather(*(client.request(m, p) for m, p in requests))


def run(app, *requests: tuple[str, str]) -> list[httpx.Response]:
    return asyncio.run(probe(app, *requests))


def expire(app) -> None:
    app.state.compile_status.at = float("-inf")


def test_ready_before_and_after_every_step_shape_is_compiled(stub):
    app, core = stub
    ready, compiled = run(app, ("GET", "/ready"), ("GET", "/ready?compiled=true"))
    body = {"ready": True, "paused": False, "fully_compiled": False, "compiled": 23, "total": 100}
    assert (ready.status_code, ready.json()) == (200, body)  # serving: traffic may come
    assert (compiled.status_code, compiled.json()) == (503, body)  # not at full speed yet
    assert core.calls == 1  # one call for both probes; its answer is reused a while
    (again,) = run(app, ("GET", "/ready?compiled=false"))
    assert again.status_code == 200 and core.calls == 1
    (bad,) = run(app, ("GET", "/ready?compiled=ture"))
    assert bad.status_code == 400 and "compiled=true" in bad.json()["error"]

    core.status = FULLY
    expire(app)
    ready, compiled = run(app, ("GET", "/ready"), ("GET", "/ready?compiled=TRUE"))
    body = {"ready": True, "paused": False, "fully_compiled": True, "compiled": 100, "total": 100}
    assert (ready.status_code, ready.json()) == (200, body)
    assert (compiled.status_code, compiled.json()) == (200, body)
    assert core.calls == 2
    expire(app)  # fully compiled stays so: the engines are not asked again
    run(app, *[("GET", "/ready?compiled=1")] * 3)
    assert core.calls == 2


def test_probes_share_one_call_and_an_unanswered_one_keeps_the_last_answer(stub, monkeypatch):
    app, core = stub
    core.delay = 0.05
    responses = run(app, *[("GET", "/ready")] * 5)
    assert [r.status_code for r in responses] == [200] * 5 and core.calls == 1
    # the engines do not answer in time (or fail): the last answer, and ready all the same
    monkeypatch.setattr(probes, "COMPILE_STATUS_TIMEOUT_S", 0.01)
    expire(app)
    ready, compiled = run(app, ("GET", "/ready"), ("GET", "/ready?compiled=true"))
    assert ready.status_code == 200 and ready.json()["compiled"] == 23
    assert compiled.status_code == 503
    core.status, core.delay = RuntimeError("no utility 'compile_status'"), 0.0
    app.state.compile_status = None  # nothing known yet
    ready, compiled = run(app, ("GET", "/ready"), ("GET", "/ready?compiled=true"))
    body = {
        "ready": True,
        "paused": False,
        "fully_compiled": False,
        "compiled": None,
        "total": None,
    }
    assert (ready.status_code, ready.json()) == (200, body)
    assert (compiled.status_code, compiled.json()) == (503, body)


def test_data_parallel_engines_are_fully_compiled_only_when_every_one_is(stub):
    """combine_results or-s the engines' flags and lists their counts: /ready sums the
    counts and requires every engine to be fully compiled."""
    app, core = stub
    core.status = combine_results([PARTLY, FULLY])
    assert core.status["fully_compiled"] is True  # (the merged flag alone would say so)
    ready, compiled = run(app, ("GET", "/ready"), ("GET", "/ready?compiled=true"))
    assert ready.status_code == 200 and compiled.status_code == 503
    assert ready.json() == {"ready": True, "paused": False, "fully_compiled": False,
                            "compiled": 123, "total": 200, "engines": [PARTLY, FULLY]}  # fmt: skip


def test_ping_and_health_then_503s_once_the_engine_is_dead(stub):
    app, core = stub
    probes_ = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/ready")]
    assert [r.status_code for r in run(app, *probes_)] == [200] * 4
    assert core.calls == 1
    core.dead = EngineDeadError("it hit a fatal error")
    expire(app)
    *plain, ready, compiled = run(app, *probes_, ("GET", "/ready?compiled=true"))
    assert [r.status_code for r in plain] == [503] * 3
    assert ready.status_code == compiled.status_code == 503
    assert ready.json() == {"ready": False, "paused": False, "fully_compiled": False,
                            "compiled": 23, "total": 100}  # fmt: skip
    assert core.calls == 1  # a dead engine is not asked


def test_real_engines_answer_compile_status_and_a_killed_one_turns_the_probes_503(
    monkeypatch,
):
    """Two engine core processes over the simulated runner (no model, no compilation: fully
    compiled, 0 shapes); then one is killed."""
    from jaxserve.engine.arg_utils import EngineArgs

    monkeypatch.setenv("JAXSERVE_SIMULATED_STEP", "0,0")
    args = EngineArgs(model="llama-3.2-1b", load_format="dummy", data_parallel_size=2,
                      max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                      num_gpu_blocks_override=64)  # fmt: skip

    async def main():
        engine = AsyncLLM.from_engine_args(args)
        app = build_app(engine, ["m"], log_stats_interval=None)
        try:
            ready, compiled, ping = await probe(
                app, ("GET", "/ready"), ("GET", "/ready?compiled=true"), ("POST", "/ping")
            )
            one = {"compiled": 0, "total": 0, "fully_compiled": True}
            assert ready.json() == {"ready": True, "paused": False, "fully_compiled": True,
                                    "compiled": 0, "total": 0, "engines": [one, one]}  # fmt: skip
            assert ready.status_code == compiled.status_code == ping.status_code == 200
            engine.engine_core.group.procs[1].kill()
            deadline = time.monotonic() + 10
            while not engine.errored and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return await probe(app, ("GET", "/health"), ("GET", "/ping"), ("GET", "/ready"))
        finally:
            engine.shutdown()
            app.state.cpu.shutdown(wait=False)

    health, ping, ready = asyncio.run(main())
    assert health.status_code == ping.status_code == ready.status_code == 503
    assert ready.json()["ready"] is False
