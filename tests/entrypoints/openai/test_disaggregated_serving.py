"""`jaxserve proxy` in front of two plain `jaxserve serve` (a tiny random-weight model, no KV
connector: the decoder recomputes the prompt), and --enable-prompt-tokens-details (on the
prefill server only)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.models.loader import DEFAULT_MODEL_NAME
from tests.entrypoints.openai.test_api_server import Server, free_port, sse_events
from tests.helpers import make_tiny_hf

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(prefill server, decode server): the tiny model with the default model's tokenizer."""
    model = make_tiny_hf("llama", tmp_path_factory.mktemp("pd"), vocab_size=49152)
    flags = [str(model), "--tokenizer", DEFAULT_MODEL_NAME, "--max-model-len", "256",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        started = [
            pool.submit(Server, *flags, "--enable-prompt-tokens-details", defaults=[]),
            pool.submit(Server, *flags, defaults=[]),
        ]
    prefill, decode = (s.result() for s in started)
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def proxy(servers):
    prefill, decode = servers
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "proxy", "--host", "127.0.0.1",
         "--port", str(port), "--prefill", prefill.url, "--decode", decode.url],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(30)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def streamed_text(url: str, path: str, body: dict) -> str:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    return "".join(c.get("text") or c["delta"].get("content") or "" for c in choices)


def test_prompt_tokens_details_count_prefix_cache_hits_only_when_enabled(servers):
    prefill, decode = servers
    body = {"prompt": list(range(1000, 1040)), "max_tokens": 2}  # 2 whole blocks and 8 tokens
    first, again = (post(prefill.url, "/v1/completions", body).json()["usage"] for _ in "12")
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
    chat = {"messages": CHAT, "max_tokens": 2, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{prefill.url}/v1/chat/completions",
                      json={**chat, "stream": True}, timeout=120) as r:  # fmt: skip
        usage = sse_events(r)[-2]["usage"]  # the stream's usage chunk
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}
    assert "prompt_tokens_details" not in post(decode.url, "/v1/completions", body).json()["usage"]
    assert "kv_transfer_params" not in post(decode.url, "/v1/completions", body).json()


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": "The capital of France is"}),
     ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 12})],
)  # fmt: skip
def test_greedy_answers_through_the_proxy_equal_direct_ones(servers, proxy, path, body):
    prefill, decode = servers
    body = {**body, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    direct = post(decode.url, path, body).json()
    before = prefill.metric("generation_tokens_total")
    via = post(proxy, path, body)
    assert via.status_code == 200, via.text
    assert via.json()["choices"] == direct["choices"]
    assert via.json()["usage"]["completion_tokens"] == 12
    assert prefill.metric("generation_tokens_total") == before + 1  # the prefill: one token
    want = direct["choices"][0].get("text") or direct["choices"][0]["message"]["content"]
    assert streamed_text(proxy, path, body) == want
    assert prefill.metric("generation_tokens_total") == before + 2


def test_client_errors_pass_through(servers, proxy):
    _, decode = servers
    body = {"prompt": "Hi", "max_tokens": 100000}
    direct, via = post(decode.url, "/v1/completions", body), post(proxy, "/v1/completions", body)
    assert via.status_code == direct.status_code == 400
    assert via.json() == direct.json()
    models = [httpx.get(f"{url}/v1/models").json()["data"][0]["id"] for url in (proxy, decode.url)]
    assert models[0] == models[1]
