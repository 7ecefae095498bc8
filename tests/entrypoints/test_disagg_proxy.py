"""`jaxserve proxy` over mock prefill and decode servers (httpx.MockTransport): what each is
sent, round robin, pass-through of answers and errors, and a failed prefill."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from starlette.testclient import TestClient

from jaxserve.entrypoints.cli import parse_args
from jaxserve.entrypoints.disagg_proxy import PREFILL_KV_TRANSFER_PARAMS, build_app

PREFILLS, DECODES = ["http://p0", "http://p1/"], ["http://d0", "http://d1"]
SSE = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'


class Upstreams:
    """The mock servers: prefill answers with kv_transfer_params naming itself (or fails as
    `prefill_fails` says); decode answers JSON naming itself, SSE when streamed, or a 400."""

    def __init__(self, prefill_fails: str | None = None):
        self.prefill_fails = prefill_fails
        self.sent: list[tuple[str, str, dict | None]] = []  # (host, path, JSON body)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        body = json.loads(request.content) if request.content else None
        self.sent.append((host, path, body))
        if host.startswith("p"):
            if self.prefill_fails == "connect":
                raise httpx.ConnectError("refused", request=request)
            if self.prefill_fails == "status":
                return httpx.Response(500, json={"error": {"message": "boom"}})
            return httpx.Response(200, json={"kv_transfer_params": {"remote_host": host}})
        if path != "/v1/completions" and path != "/v1/chat/completions":
            return httpx.Response(200, json={"from": host, "path": path})
        if body.get("max_tokens") == -1:
            return httpx.Response(400, json={"error": {"message": "max_tokens", "code": 400}})
        if body.get("stream"):
            return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"from": host})


def proxy(upstreams: Upstreams) -> TestClient:
    return TestClient(build_app(PREFILLS, DECODES, httpx.MockTransport(upstreams)))


def test_prefill_gets_one_token_then_decode_the_request_with_its_kv_transfer_params():
    upstreams = Upstreams()
    body = {"model": "m", "prompt": "Hi", "max_tokens": 50, "stream": False,
            "kv_transfer_params": {"from": "the client"}}  # fmt: skip
    with proxy(upstreams) as client:
        r = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.json() == {"from": "d0"}
    (_, path, prefill), (_, _, decode) = upstreams.sent
    assert path == "/v1/completions"
    assert prefill == {**body, "max_tokens": 1, "stream": False,
                       "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}  # fmt: skip
    assert decode == {**body, "kv_transfer_params": {"remote_host": "p0"}}


def test_chat_stream_passes_through_and_requests_round_robin():
    upstreams = Upstreams()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with proxy(upstreams) as client:
        for _ in range(3):
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.content == SSE
            assert r.headers["content-type"].startswith("text/event-stream")
    hosts = [host for host, _, _ in upstreams.sent]
    assert hosts == ["p0", "d0", "p1", "d1", "p0", "d0"]
    prefill, decode = upstreams.sent[0][2], upstreams.sent[1][2]
    assert prefill["max_completion_tokens"] == prefill["max_tokens"] == 1
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert decode == {**body, "kv_transfer_params": {"remote_host": "p0"}}


@pytest.mark.parametrize("fails", ["connect", "status"])
def test_failed_prefill_leaves_the_prompt_to_the_decoder(fails, caplog):
    upstreams = Upstreams(prefill_fails=fails)
    body = {"prompt": "Hi", "kv_transfer_params": {"from": "the client"}}
    with caplog.at_level(logging.WARNING, "jaxserve.disagg_proxy"), proxy(upstreams) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json() == {"from": "d0"}
    assert upstreams.sent[-1] == ("d0", "/v1/completions", {"prompt": "Hi"})
    assert "prefill at http://p0/v1/completions failed" in caplog.text


def test_errors_models_and_health():
    upstreams = Upstreams()
    with proxy(upstreams) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens"
        r = client.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "invalid request body" in r.json()["error"]["message"]
        for path in ("/v1/models", "/health", "/health"):
            assert client.get(path).json() == {"from": "d0", "path": path}
    down = TestClient(build_app(PREFILLS, DECODES, httpx.MockTransport(_refuse)))
    with down as client:
        r = client.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused", request=request)


def test_cli_takes_several_prefill_and_decode_urls():
    args = parse_args(["proxy", "--prefill", "http://a", "--prefill", "http://b",
                       "--decode", "http://c", "--port", "9000"])  # fmt: skip
    assert (args.prefill, args.decode, args.host, args.port) == (
        ["http://a", "http://b"],
        ["http://c"],
        "0.0.0.0",
        9000,
    )
    with pytest.raises(SystemExit):
        parse_args(["proxy", "--prefill", "http://a"])  # no decoder
