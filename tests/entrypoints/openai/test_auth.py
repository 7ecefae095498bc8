"""Who may call what, in process (build_app over AsyncLLM and a stand-in engine core, the
development routes on): with an API key every route but the probes needs it, the Bearer scheme
in any case; every POST declares a JSON body, even one without a body; the development routes
only with a key; /collective_rpc calls only the listed runner methods, its timeout checked,
and every failure is JSON."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import msgspec
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.core_control import COLLECTIVE_RPC_METHODS, CoreControl
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.entrypoints.cli import build_parser
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.server_setup import check_server_args
from tests.engine.test_kv_transfer_params import FakeCore, config

KEY = "sekrit"
AUTH = {"authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}
PROBES = [("GET", "/health"), ("HEAD", "/health"), ("GET", "/ping"), ("POST", "/ping"),
          ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/version")]  # fmt: skip
DEV_POSTS = ["/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache",
             "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
             "/finish_weight_update", "/collective_rpc"]  # fmt: skip


class Runner:
    """A model runner stand-in: what collective_rpc may call, and what it must not."""

    def __init__(self):
        self.kv_initialized = []

    def max_step_tokens(self) -> int:
        return 512

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_initialized.append(num_blocks)  # (the real one reallocates: the core's end)


class ControlCore(FakeCore):
    """A stand-in core answering the utility calls the development routes and probes make;
    collective_rpc is CoreControl's own, over `runner`. Every call is recorded in `calls`;
    `delay` seconds before each answer; `error`: what each call raises."""

    def __init__(self):
        super().__init__()
        self.runner, self.calls, self.delay, self.error = Runner(), [], 0.0, None

    async def call_utility_async(self, method: str, *args):
        self.calls.append(method)
        args = msgspec.msgpack.decode(msgspec.msgpack.encode(args))  # as the wire carries them
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        if method == "collective_rpc":
            return CoreControl(SimpleNamespace(runner=self.runner)).collective_rpc(*args)
        if method == "compile_status":
            return {"compiled": 1, "total": 1, "fully_compiled": True}
        return True


@pytest.fixture
def app(monkeypatch):
    monkeypatch.setenv("JAXSERVE_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    core = ControlCore()
    engine = AsyncLLM(config(), core, tokenizer=None)
    app = build_app(engine, ["m"], api_key=KEY, log_stats_interval=None)
    app.state.core = core
    yield app
    engine.shutdown()
    app.state.cpu.shutdown(wait=False)


def send(app, *requests: dict) -> list[httpx.Response]:
    """The responses to `requests` (httpx request kwargs), sent one after another."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(**r) for r in requests]

    return asyncio.run(main())


def rpc(body, headers=None) -> dict:
    content = body if isinstance(body, str) else json.dumps(body)
    return {"method": "POST", "url": "/collective_rpc", "content": content,
            "headers": headers or {**AUTH, **JSON}}  # fmt: skip


def test_without_the_key_only_the_probes_answer(app):
    guarded = [
        *(("POST", path) for path in DEV_POSTS),
        ("GET", "/is_sleeping"), ("GET", "/is_paused"), ("GET", "/get_world_size"),
        ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/score"), ("POST", "/rerank"),
        ("POST", "/v2/rerank"), ("POST", "/classify"), ("POST", "/pooling"),
        ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/load_lora_adapter"),
        ("GET", "/no-such-route"), ("GET", "/health/"), ("GET", "//health"),
    ]  # fmt: skip
    refused = send(app, *({"method": m, "url": p, "headers": JSON, "content": "{}"}
                          for m, p in guarded))  # fmt: skip
    for (method, path), r in zip(guarded, refused, strict=True):
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["type"] == "AuthenticationError"
    (messages,) = send(app, {"method": "POST", "url": "/v1/messages", "headers": JSON})
    assert messages.status_code == 401
    assert messages.json()["error"]["type"] == "authentication_error"  # Anthropic's shape
    assert app.state.core.calls == []  # nothing reached the engine
    for (method, path), r in zip(PROBES, send(app, *({"method": m, "url": p} for m, p in PROBES)),
                                 strict=True):  # fmt: skip
        assert r.status_code == 200, (method, path, r.status_code)


def test_a_refusal_before_a_large_body_is_read_closes_the_connection(app):
    """The server does not read (and parse) megabytes it will discard: a refusal sent while
    more than DRAIN_BYTES of the body are still to come says Connection: close; one after a
    small body, or after the body was read, keeps the connection."""
    empties = b'{"messages": [' + b",".join([b"{}"] * 1_000_000) + b"]}"  # 3 MB

    async def chunked():  # as a socket delivers it: refused by the scan after its first MiB
        for at in range(0, len(empties), 1 << 16):
            yield empties[at : at + (1 << 16)]

    keyless, small, scanned, served = send(
        app,
        {"method": "POST", "url": "/tokenize", "headers": JSON, "content": empties},
        {"method": "POST", "url": "/tokenize", "headers": JSON, "content": "{}"},
        {"method": "POST", "url": "/tokenize", "headers": {**AUTH, **JSON}, "content": chunked()},
        rpc({"method": "max_step_tokens"}),
    )
    assert keyless.status_code == 401 and keyless.headers.get("connection") == "close"
    assert small.status_code == 401 and "connection" not in small.headers
    assert scanned.status_code == 400 and scanned.headers.get("connection") == "close"
    assert "messages" in scanned.json()["error"]["message"]
    assert served.status_code == 200 and "connection" not in served.headers


@pytest.mark.parametrize("header", [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY} "])
def test_the_bearer_scheme_is_read_in_any_case(app, header):
    (r,) = send(app, {"method": "GET", "url": "/v1/models", "headers": {"authorization": header}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "headers",
    [{"authorization": "Bearer wrong"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"},
     {"authorization": f"Bearer {KEY}x"}, {"x-api-key": KEY}],
)  # fmt: skip
def test_a_wrong_key_or_scheme_is_refused(app, headers):
    (r,) = send(app, {"method": "GET", "url": "/v1/models", "headers": headers})
    assert r.status_code == 401


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_every_post_declares_json_even_without_a_body(app, content_type):
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    paths = [*DEV_POSTS, "/v1/load_lora_adapter", "/v1/messages"]
    responses = send(app, *({"method": "POST", "url": p, "headers": headers} for p in paths))
    for path, r in zip(paths, responses, strict=True):
        assert r.status_code == 400, (path, r.status_code)
        error = r.json()["error"]
        assert "application/json" in error["message"]
        assert (repr(content_type) if content_type else "no Content-Type") in error["message"]
        anthropic = path == "/v1/messages"
        assert error["type"] == ("invalid_request_error" if anthropic else "BadRequestError")
    assert app.state.core.calls == []
    declared = {**AUTH, "content-type": "Application/JSON; charset=utf-8"}
    ok = send(app, *({"method": "POST", "url": p, "headers": declared}
                     for p in ("/reset_prefix_cache", "/resume")))  # fmt: skip
    assert [r.status_code for r in ok] == [200, 200]


def test_the_development_routes_need_an_api_key(monkeypatch):
    monkeypatch.setenv("JAXSERVE_SERVER_DEV_MODE", "1")
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    engine = AsyncLLM(config(), FakeCore(), tokenizer=None)
    with pytest.raises(
        ValueError, match=r"JAXSERVE_SERVER_DEV_MODE=1 needs an API key \(--api-key"
    ):
        build_app(engine, ["m"], log_stats_interval=None)
    parse = build_parser().parse_args
    with pytest.raises(SystemExit, match="JAXSERVE_SERVER_DEV_MODE=1 needs an API key"):
        check_server_args(parse(["serve"]))
    check_server_args(parse(["serve", "--api-key", KEY]))
    monkeypatch.setenv("JAXSERVE_API_KEY", KEY)
    check_server_args(parse(["serve"]))
    engine.shutdown()


def test_collective_rpc_calls_only_the_listed_runner_methods(app):
    runner = app.state.core.runner
    refused = send(app, *(rpc({"method": m, "args": [1]})
                          for m in ("initialize_kv_cache", "_private", "__init__")))  # fmt: skip
    for r in refused:
        assert r.status_code == 400
        assert all(m in r.json()["error"] for m in COLLECTIVE_RPC_METHODS)
    assert "'initialize_kv_cache' is not a runner method" in refused[0].json()["error"]
    assert runner.kv_initialized == []
    ok, health = send(app, rpc({"method": "max_step_tokens"}),
                      {"method": "GET", "url": "/health"})  # fmt: skip
    assert ok.json() == {"results": [512]} and health.status_code == 200


@pytest.mark.parametrize(
    "body, named",
    [('{"method": "max_step_tokens", "timeout": -1}', "'timeout'"),
     ('{"method": "max_step_tokens", "timeout": 0}', "'timeout'"),
     ('{"method": "max_step_tokens", "timeout": "5"}', "'timeout'"),
     ('{"method": "max_step_tokens", "timeout": true}', "'timeout'"),
     ('{"method": "max_step_tokens", "timeout": NaN}', "'timeout'"),
     ('{"method": "max_step_tokens", "timeout": 1e999}', "'timeout'"),
     ('{"method": "max_step_tokens", "args": {}}', "'args'"),
     ('{"method": ["max_step_tokens"]}', "'method'"),
     ('{"method": "max_step_tokens", "args": [18446744073709551616]}', "64-bit range"),
     ("[1]", "JSON object"), ("{nope", "not JSON"), ("[" * 100_000, "nested too deep")],
)  # fmt: skip
def test_collective_rpc_bad_values_are_json_400s_naming_them(app, body, named):
    (r,) = send(app, rpc(body))
    assert r.status_code == 400 and named in r.json()["error"], r.text


def test_collective_rpc_past_its_timeout_or_on_a_dead_engine_is_json(app):
    core = app.state.core
    core.delay = 5.0
    (late,) = send(app, rpc({"method": "max_step_tokens", "timeout": 0.01}))
    assert late.status_code == 408 and "within 0.01 s" in late.json()["error"]
    core.delay, core.error = 0.0, EngineDeadError("killed")
    (dead,) = send(app, rpc({"method": "max_step_tokens"}))
    assert dead.status_code == 503 and "killed" in dead.json()["error"]
