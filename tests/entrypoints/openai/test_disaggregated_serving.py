"""Disaggregated prefill / decode over HTTP: `jaxserve proxy` in front of a prefill server
(ZmqConnector, kv_producer) and a decode server (kv_consumer) on a tiny random-weight model;
--enable-prompt-tokens-details on both. Greedy answers through the proxy equal the decode
server's own (which computes the whole prompt when asked directly), the decode server computes
at most one block of each proxied prompt, and a dead prefill server costs a recompute."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME
from tests.entrypoints.openai.test_api_server import Server, free_port, sse_events
from tests.helpers import make_tiny_hf

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(prefill server, decode server): the tiny model with the default model's tokenizer."""
    model = make_tiny_hf("llama", tmp_path_factory.mktemp("pd"), vocab_size=49152)
    flags = [str(model), "--tokenizer", DEFAULT_MODEL_NAME, "--max-model-len", "256",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]  # fmt: skip
    flags += ["--enable-prompt-tokens-details"]
    kv = {"kv_connector": "ZmqConnector", "kv_port": free_port(),
          "kv_connector_extra_config": {"timeout_s": 2}}  # fmt: skip
    roles = [json.dumps({**kv, "kv_role": role}) for role in ("kv_producer", "kv_consumer")]
    with ThreadPoolExecutor(2) as pool:
        started = [
            pool.submit(Server, *flags, "--kv-transfer-config", role, defaults=[]) for role in roles
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


def test_prompt_tokens_details_count_prefix_cache_hits(servers):
    prefill, decode = servers
    body = {"prompt": list(range(1000, 1040)), "max_tokens": 2}  # 2 whole blocks and 8 tokens
    first, again = (post(prefill.url, "/v1/completions", body).json()["usage"] for _ in "12")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
    chat = {"messages": CHAT, "max_tokens": 2, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{prefill.url}/v1/chat/completions",
                      json={**chat, "stream": True}, timeout=120) as r:  # fmt: skip
        usage = sse_events(r)[-2]["usage"]  # the stream's usage chunk
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}
    assert post(decode.url, "/v1/completions", body).json()["kv_transfer_params"] is None


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


def test_the_decode_server_computes_at_most_one_block_of_a_proxied_prompt(servers, proxy):
    prefill, decode = servers
    prompt = list(range(2000, 2000 + 75))  # 4 whole blocks of 16 and 11 tokens
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    # One server's answer: the prefill server computing it all (the decode server's cache
    # stays without this prompt, so the proxied request below must load it).
    alone = post(prefill.url, "/v1/completions", body).json()["choices"][0]["text"]
    hits = decode.metric("external_prefix_cache_hits_total")
    via = post(proxy, "/v1/completions", body).json()
    assert via["choices"][0]["text"] == alone
    assert via["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # (75 - 1) // 16
    assert decode.metric("external_prefix_cache_hits_total") == hits + 64
    assert decode.metric("kv_transfer_blocks_total", 'direction="load"') >= 4
    other = {**body, "prompt": [p + 1 for p in prompt]}
    alone = post(prefill.url, "/v1/completions", other).json()["choices"][0]["text"]
    assert streamed_text(proxy, "/v1/completions", other) == alone
    assert decode.metric("external_prefix_cache_hits_total") == hits + 128


def test_a_dead_prefill_server_makes_the_decode_server_recompute(servers, proxy):
    """Last in the module: it stops the prefill server."""
    prefill, decode = servers
    prompt = list(range(3000, 3000 + 70))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    params = post(prefill.url, "/v1/completions", {
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
    }).json()["kv_transfer_params"]  # fmt: skip
    assert params["do_remote_prefill"] and params["remote_port"]
    prefill.stop()  # its KV never reaches the decode server
    failed = decode.metric("kv_transfer_failed_loads_total")
    start = time.monotonic()
    out = post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params}).json()
    assert time.monotonic() - start < 30  # the 2 s timeout, then the prompt's compute
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert decode.metric("kv_transfer_failed_loads_total") == failed + 1
    alone = post(decode.url, "/v1/completions", {**body, "prompt": prompt}).json()
    assert out["choices"] == alone["choices"]
    via = post(proxy, "/v1/completions", {**body, "prompt": [p + 1 for p in prompt]})
    assert via.status_code == 200  # the proxy falls back to the decode server alone
    assert decode.metric("num_requests_running") == 0
