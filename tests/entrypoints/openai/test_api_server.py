"""`jaxserve serve` end to end: a real uvicorn server on 127.0.0.1 (its own process, the
EngineCore in another) on the default model, driven by the official openai client and raw HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.require import import_or_skip

openai = import_or_skip("openai")  # absent on the GPU machine: skip (fail in CI: require.py)

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "smol"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# A request that streams long enough to be interrupted.
LONG_STREAM = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
               "ignore_eos": True, "stream": True}  # fmt: skip
# Steps of ~20 ms (the default model's pace on CPU) on the tiny model (conftest's
# `tiny_model`): streams last long enough to be interrupted.
TINY_ENV = {"JAXSERVE_TEST_STEP_DELAY_S": "0.02"}
# (--served-model-name takes several names: not last, or a model path after it is one)
SERVER_FLAGS = ["--served-model-name", MODEL, "--max-num-seqs", "8",
                "--max-num-batched-tokens", "128", "--max-model-len", "512"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of n consecutive free ports (a multi-host master port and the two after)."""
    while True:
        first = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("", port))
            return first
        except OSError:
            continue


class Server:
    """`jaxserve serve` on a free port (SERVER_FLAGS unless `defaults` says otherwise), started
    with `command` (default: this interpreter); ready once /health answers 200. Its output
    goes to a log file whose tail start-up failures show."""

    def __init__(
        self, *flags: str, env: dict | None = None, command: list[str] | None = None,
        defaults: list[str] = SERVER_FLAGS, timeout: float = 300,
    ):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = command or [sys.executable, "-m", "jaxserve.entrypoints.cli"]
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (lives as long as the server)
        self.proc = subprocess.Popen(
            [*command, "serve", "--host", "127.0.0.1", "--port", str(self.port), *defaults,
             *flags],
            env={**os.environ, "JAXSERVE_LOG_STATS_INTERVAL": "1", **(env or {})},
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the server exited during start-up:\n{self.tail()}"
            assert time.monotonic() < deadline, f"the server did not start:\n{self.tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polled often: every server start of the suite waits here

    def tail(self, lines: int = 40) -> str:
        """The last lines of the server's output."""
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.readlines()[-lines:])

    def core_pid(self) -> int:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid), "-f", "core_proc"], capture_output=True, text=True
        ).stdout.split()
        assert len(out) == 1, out
        return int(out[0])

    def metric(self, name: str, label: str = "") -> float:
        """The value of vllm:<name> (the sample whose labels contain `label`)."""
        text = httpx.get(f"{self.url}/metrics").text
        for labels, value in re.findall(rf"^vllm:{name}{{([^}}]*)}} (\S+)$", text, re.M):
            if label in labels:
                return float(value)
        raise AssertionError(f"{name} {label} not in /metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def keyed_post(server, path: str, body: dict) -> httpx.Response:
    """POST `body` as JSON with the key (a keyed server asks for it on every route but the
    probes)."""
    return httpx.post(f"{server.url}{path}", json=body, headers=auth())


def sse_events(response: httpx.Response) -> list:
    """Every `data:` payload of an SSE response, decoded ([DONE] kept as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_chat_stream_deltas_equal_the_whole_answer(client, server):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    text = whole.choices[0].message.content
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant" and "Paris" in text
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    body = {
        "model": MODEL,
        "messages": CHAT,
        "temperature": 0,
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=auth(), timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == text
    finishes = [c for c in content if c["choices"][0]["finish_reason"] is not None]
    assert len(finishes) == 1 and finishes[0] is content[-1]
    assert finishes[0]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == whole.usage.model_dump(exclude_none=True)


def test_completion_stream_through_the_openai_client(client):
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=16)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert sum(c.choices[0].finish_reason is not None for c in chunks if c.choices) == 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_logprobs_echo_and_usage(client, server):
    prompt = "Once upon a time"
    count = keyed_post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    out = client.completions.create(
        model=MODEL,
        prompt=[prompt, "Hello"],
        n=3,
        max_tokens=5,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == 30
    assert (
        out.usage.prompt_tokens
        == count + keyed_post(server, "/tokenize", {"prompt": "Hello"}).json()["count"]
    )

    lp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, temperature=0, echo=True
    )
    choice = lp.choices[0]
    assert choice.text.startswith(prompt)
    n_tokens = count + 4
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == n_tokens
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])
    # the actual token first, then the top 2 (it is counted once where it is among them), as
    # vLLM does
    pairs = zip(choice.logprobs.tokens[1:], choice.logprobs.top_logprobs[1:], strict=True)
    for token, top in pairs:
        assert next(iter(top)) == token and len(top) in (2, 3)
        assert len(top) == 2 or top[token] <= min(list(top.values())[1:])
    greedy_top = max(choice.logprobs.top_logprobs[-1].values())
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(greedy_top)

    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=3, temperature=0
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_stop_strings_and_sampling_fields(client):
    base = client.completions.create(
        model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=20
    )
    text = base.choices[0].text
    word = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    cut = client.completions.create(
        model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=20, stop=[word]
    )
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == word
    assert cut.choices[0].text == text[: text.index(word)]
    fields = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 8,
            "ignore_eos": True,
            "logit_bias": {"42": 1.0},
            "user": "u",
        },
    )
    assert fields.usage.completion_tokens == 8


def test_bad_requests_fail_alone_with_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=4)
    assert "maximum context length is 512 tokens" in e.value.message
    assert "600 input tokens" in e.value.message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"max_tokens": "many"})
    with pytest.raises(openai.BadRequestError, match="logprobs=21 exceeds max_logprobs=20"):
        client.completions.create(model=MODEL, prompt="hi", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL, prompt="hi", logit_bias={"99999999": 1})
    with pytest.raises(openai.BadRequestError, match="Invalid type: objekt"):
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            },
        )
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.chat.completions.create(
            model=MODEL, messages=CHAT, stream_options={"include_usage": True}
        )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi")
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    json_headers = {**auth(), "content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", headers=json_headers, content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "code"}
    # Still serving, and unknown fields are ignored.
    ok = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"no_such_field": 1}
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_models_version_tokenize_detokenize_health(server):
    models = httpx.get(f"{server.url}/v1/models", headers=auth()).json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 512
    assert {"created", "owned_by"} <= set(card)
    assert "version" in httpx.get(f"{server.url}/version").json()
    tok = keyed_post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    back = keyed_post(server, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    chat_tok = keyed_post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat_tok["count"] > tok["count"]
    assert keyed_post(server, "/detokenize", {"tokens": [10**8]}).status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_disconnected_stream_is_aborted_and_frees_its_blocks(server):
    body = LONG_STREAM
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=auth(), timeout=60
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.metric("num_requests_running") == 1
    gone = time.monotonic()  # the connection is closed here
    while server.metric("num_requests_running") != 0:
        assert time.monotonic() - gone < 1.0, "the disconnected request still runs"
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while server.metric("kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.metric("request_success_total", 'finished_reason="abort"') >= 1


def test_disconnected_non_streaming_request_is_aborted(server):
    body = {**LONG_STREAM, "stream": False}
    aborted = server.metric("request_success_total", 'finished_reason="abort"')
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(),
                   timeout=httpx.Timeout(5, read=1.0))  # fmt: skip
    gone = time.monotonic()
    while server.metric("num_requests_running") != 0:
        assert time.monotonic() - gone < 1.0, "the disconnected request still runs"
        time.sleep(0.05)
    assert server.metric("request_success_total", 'finished_reason="abort"') == aborted + 1


def test_metrics_count_tokens_and_latencies(server, client):
    before = server.metric("generation_tokens_total")
    client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert server.metric("generation_tokens_total") == before + 6
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        count = re.search(rf"^vllm:{name}_count{{[^}}]*}} (\S+)$", text, re.M)
        assert count and float(count.group(1)) > 0, name
    for name in (
        "prompt_tokens_total",
        "prefix_cache_queries_total",
        "num_preemptions_total",
        "num_requests_waiting",
    ):
        assert f"vllm:{name}" in text


def test_dead_engine_ends_streams_and_the_server_exits_1(tiny_model):
    """vLLM's behaviour: in-flight requests get the error at once, then the server exits
    non-zero so a supervisor restarts it. 64 KV blocks (the one 400-token stream needs 26), not
    the 0.5 GiB default's 131072: zero-filling that took 0.5-6 s of the start-up."""
    server = Server(*tiny_model, "--num-gpu-blocks-override", "64", env=TINY_ENV)
    try:
        body = LONG_STREAM
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(server.core_pid(), signal.SIGKILL)
            start = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - start < 10
        assert rest[-1] == "data: [DONE]"
        assert "EngineCore is dead" in json.loads(rest[-2][len("data: ") :])["error"]["message"]
        assert server.proc.wait(60) == 1
        assert "the engine core died" in server.tail()
    finally:
        server.stop()


def test_sigterm_drains_every_accepted_stream_refuses_new_and_exits_0(tiny_model):
    """Streams accepted just before SIGTERM (some still queued behind --max-num-seqs 8,
    waiting for their first token) all run to their end; new connections are refused."""
    import concurrent.futures

    server = Server(*tiny_model, env=TINY_ENV)
    body = {**LONG_STREAM, "max_tokens": 24}
    started = []

    def one_stream(i: int) -> tuple[int, int, str | None]:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            started.append(i)
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
        texts = [c for c in chunks if c.get("choices")]
        reason = texts[-1]["choices"][0]["finish_reason"] if texts else None
        return r.status_code, len(texts), reason

    num_streams = 12
    with concurrent.futures.ThreadPoolExecutor(num_streams) as pool:
        futures = [pool.submit(one_stream, i) for i in range(num_streams)]
        deadline = time.monotonic() + 60
        while len(started) < num_streams:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):
            httpx.post(
                f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5
            )
        results = [f.result() for f in futures]
    assert server.proc.wait(60) == 0
    for status, num_chunks, reason in results:
        assert status == 200 and reason == "length" and num_chunks >= 1, results
