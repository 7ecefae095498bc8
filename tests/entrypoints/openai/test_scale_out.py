"""Scaling out, on tiny models with the default model's tokenizer: `jaxserve serve -dp 2
--api-server-count 2` (two engine cores, one XLA CPU device each, behind a DP coordinator; two
HTTP servers sharing the port). One model over two jax.distributed processes is
tests/distributed/test_multihost.py's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.entrypoints.openai.test_api_server import (
    LONG_STREAM,
    MODEL,
    TINY_ENV,
    Server,
    sse_events,
)

pytestmark = pytest.mark.slow

PROMPTS = [f"Write a sentence about the number {i}." for i in range(64)]


@pytest.fixture(scope="module")
def scaled(tiny_model):
    s = Server(*tiny_model, "-dp", "2", "--api-server-count", "2", env=TINY_ENV)
    # /health can answer before both engines' series are in /metrics (seen once in a full
    # run: the first test's read of them failed); every test here reads them
    deadline = time.monotonic() + 60
    while True:
        try:
            [completed(s, engine) for engine in (0, 1)]
            break
        except AssertionError:
            assert time.monotonic() < deadline, "the engines' metrics never appeared"
            time.sleep(0.2)
    yield s
    s.stop()


def one_engine_texts(tiny_model: list[str], prompts: list[str], max_tokens: int) -> list[str]:
    """The greedy texts of one engine (in this process) on the tiny model."""
    model, _, tokenizer = tiny_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(model, tokenizer=tokenizer, max_model_len=512, max_num_seqs=8,
                  max_num_batched_tokens=128)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]


def engine_pids(server: Server) -> dict[int, int]:
    """engine index -> pid of the launcher's engine core processes."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.proc.pid)],
                         capture_output=True, text=True).stdout  # fmt: skip
    found = re.findall(r"^\s*(\d+) .*jaxserve\.engine\.core_proc \S+ (\d+)$", out, re.M)
    return {int(index): int(pid) for pid, index in found}


def next_event(lines) -> str:
    """The next `data:` line of an SSE stream."""
    while not (line := next(lines)).startswith("data: "):
        pass
    return line


def wait_metric(server: Server, name: str, label: str, value: float, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while server.metric(name, label) != value:
        assert time.monotonic() < deadline, f"{name}{{{label}}} is {server.metric(name, label)}"
        time.sleep(0.1)


def completed(server: Server, engine: int) -> float:
    return sum(server.metric("request_success_total", f'engine="{engine}",finished_reason="{r}"')
               for r in ("stop", "length", "abort"))  # fmt: skip


def test_streaming_load_spreads_over_both_engines_and_servers_with_dp1_tokens(scaled, tiny_model):
    before = [completed(scaled, e) for e in (0, 1)]

    def stream(prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{scaled.url}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"]
        return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(stream, PROMPTS))  # any failure raises here: 0 failed
    done = [completed(scaled, e) - b for e, b in zip((0, 1), before, strict=True)]
    assert sum(done) == 64 and all(0.4 * 64 <= n <= 0.6 * 64 for n in done), done
    assert texts[:6] == one_engine_texts(tiny_model, PROMPTS[:6], 12)  # the same greedy text
    log = scaled.tail(2000)
    # both API servers took connections (how many each is the kernel's accept order: on a busy
    # 2-core machine one took 62 of 64 once)
    for i in (0, 1):
        assert re.search(rf"\(APIServer{i} pid=\d+\) .*POST /v1/completions", log)
    for engine in (0, 1):  # every block back
        wait_metric(scaled, "kv_cache_usage_perc", f'engine="{engine}"', 0.0)
        wait_metric(scaled, "num_requests_running", f'engine="{engine}"', 0.0)


def test_a_client_disconnect_frees_the_kv_of_the_engine_it_ran_on(scaled):
    bad = httpx.post(f"{scaled.url}/v1/completions", json={**LONG_STREAM, "stream": False},
                     headers={"X-data-parallel-rank": "2"}, timeout=30)  # fmt: skip
    assert bad.status_code == 400 and "X-data-parallel-rank '2'" in bad.text
    streams = []
    for engine in (0, 1):
        cm = httpx.stream("POST", f"{scaled.url}/v1/completions", json=LONG_STREAM,
                          headers={"X-data-parallel-rank": str(engine)}, timeout=300)  # fmt: skip
        lines = cm.__enter__().iter_lines()
        next_event(lines)  # a first token: it runs
        streams.append((cm, lines))
    for engine in (0, 1):
        assert scaled.metric("num_requests_running", f'engine="{engine}"') == 1
    streams[1][0].__exit__(None, None, None)  # the client of engine 1's request goes away
    wait_metric(scaled, "num_requests_running", 'engine="1"', 0.0)
    wait_metric(scaled, "kv_cache_usage_perc", 'engine="1"', 0.0)
    assert scaled.metric("num_requests_running", 'engine="0"') == 1  # untouched
    next_event(streams[0][1])
    streams[0][0].__exit__(None, None, None)
    wait_metric(scaled, "kv_cache_usage_perc", 'engine="0"', 0.0)


def test_a_killed_engine_fails_the_streams_and_the_server_exits_1(scaled):
    pids = engine_pids(scaled)
    assert sorted(pids) == [0, 1], pids
    with httpx.stream("POST", f"{scaled.url}/v1/completions", json=LONG_STREAM,
                      headers={"X-data-parallel-rank": "0"}, timeout=60) as r:  # fmt: skip
        lines = r.iter_lines()
        next_event(lines)
        os.kill(pids[1], signal.SIGKILL)  # not the engine of this stream: still all fail
        start = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - start < 10
    assert rest[-1] == "data: [DONE]" and "EngineCore is dead" in rest[-2], rest[-3:]
    assert scaled.proc.wait(30) == 1
    deadline = time.monotonic() + 10  # and the other engine is stopped with it
    while os.path.exists(f"/proc/{pids[0]}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pids[0]}")
