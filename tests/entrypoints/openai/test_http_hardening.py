"""The HTTP layer of `jaxserve serve` against hostile requests, in process (build_app over
AsyncLLM and a stand-in engine core: no model, no server): non-JSON bodies, bodies too large,
nested too deep or holding too many values, integers too wide for the core's wire, CORS only
when configured, no API key in the start-up log, /detokenize off the event loop, request chat
templates only when trusted, chat_template_kwargs plain data, and chat templates that would
run for minutes or take 10 GB failing alone, holding up no other request."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import httpx
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.cli import build_parser
from jaxserve.entrypoints.openai.api_server import build_app, cors_settings, ready_message
from jaxserve.entrypoints.openai.serve_options import ServeOptions
from jaxserve.entrypoints.openai.server_setup import check_server_args
from jaxserve.entrypoints.openai.template_worker import TemplateRenderer
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import FakeCore, config

CHAT = [{"role": "user", "content": "Hello"}]
NESTED_LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's (it has a chat template)


def serve(tokenizer, requests: list, **app_kwargs) -> list[httpx.Response]:
    """The responses of an app over a stand-in core to `requests` (httpx request kwargs, or
    async functions of the client that return a response), sent concurrently."""
    cfg = config(max_model_len=256)
    cfg.model.vocab_size = len(tokenizer)
    engine = AsyncLLM(cfg, FakeCore(), tokenizer=tokenizer)
    app = build_app(engine, ["m"], log_stats_interval=None, **app_kwargs)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await asyncio.gather(
                *(client.request(**r) if isinstance(r, dict) else r(client) for r in requests)
            )

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)


def post(path: str, body, **kwargs) -> dict:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return {"method": "POST", "url": path, "content": content, "headers": headers, **kwargs}


def message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


# ---------------------------------------------------------------------- bodies
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_that_is_not_declared_json_is_refused(tokenizer, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    requests = [{"method": "POST", "url": u, "content": body, "headers": headers}
                for u in ("/v1/completions", "/v1/chat/completions", "/tokenize")]  # fmt: skip
    for r in serve(tokenizer, requests):
        assert r.status_code == 400
        assert "application/json" in message(r)
        assert repr(content_type) in message(r) if content_type else "no Content-Type" in message(r)
    ok = post("/v1/completions", body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert serve(tokenizer, [ok])[0].status_code == 200


def test_a_body_over_the_limit_is_refused_while_it_streams_in(tokenizer):
    sent = []

    async def chunks():  # no Content-Length: chunked
        for _ in range(100):
            sent.append(1)
            yield b" " * 500

    big = {"method": "POST", "url": "/v1/completions", "content": chunks(),
           "headers": {"content-type": "application/json"}}  # fmt: skip
    declared = post("/v1/completions", {"prompt": "x" * 5000})  # with a Content-Length
    small = post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
    r_big, r_declared, r_small = serve(
        tokenizer, [big, declared, small], max_request_body_bytes=2000
    )
    assert r_big.status_code == 413 and "2000 (--max-request-body-bytes)" in message(r_big)
    assert len(sent) < 100  # refused before the rest was read
    assert r_declared.status_code == 413
    assert f"has {len(declared['content'])} bytes" in message(r_declared)
    assert r_small.status_code == 200


@pytest.mark.parametrize("depth", [65, 10_000])
def test_json_nested_too_deep_is_a_400(tokenizer, depth):
    deep = "[" * depth + "]" * depth
    body = (
        '{"prompt": "hi", "max_tokens": 1, "response_format": {"type": "text", "a": ' + deep + "}}"
    )
    (r,) = serve(tokenizer, [post("/v1/completions", body)])
    assert r.status_code == 400 and "nested more than 64 levels" in message(r)
    fine = "[" * 60 + "]" * 60
    body = (
        '{"prompt": "hi", "max_tokens": 1, "response_format": {"type": "text", "a": ' + fine + "}}"
    )
    assert serve(tokenizer, [post("/v1/completions", body)])[0].status_code == 200


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**400], ids=["2^64", "-2^63-1", "1e400"])
@pytest.mark.parametrize(
    "field, body",
    [
        ("kv_transfer_params", lambda v: {"prompt": "hi", "kv_transfer_params": {"a": [{"b": v}]}}),
        ("prompt", lambda v: {"prompt": [1, 2, v]}),
        ("response_format", lambda v: {"prompt": "hi", "response_format": {"type": v}}),
        ("chat_template_kwargs", lambda v: {"messages": CHAT, "chat_template_kwargs": {"x": v}}),
        ("tools", lambda v: {"messages": CHAT, "tools": [{"function": {"name": "f", "x": v}}]}),
        ("messages", lambda v: {"messages": [{"role": "user", "content": "hi", "n": v}]}),
    ],
)
def test_integers_too_wide_for_64_bits_are_a_400_naming_the_field(tokenizer, field, value, body):
    path = "/v1/chat/completions" if field in ("chat_template_kwargs", "tools", "messages") else (
        "/v1/completions")  # fmt: skip
    content = json.dumps({**body(value), "max_tokens": 1})  # json writes big ints in full
    (r,) = serve(tokenizer, [post(path, content.encode())])
    assert r.status_code == 400, r.text
    assert message(r).startswith(field) and "64-bit range" in message(r)
    (ok,) = serve(tokenizer, [post(path, {**body(2**64 - 1 if value > 0 else -(2**63)),
                                          "max_tokens": 1})])  # fmt: skip
    assert "64-bit" not in ok.text


def test_structure_too_large_is_refused_naming_the_field(tokenizer):
    empties = b'{"messages": [' + b",".join([b"{}"] * 3_800_000) + b"]}"  # 11.4 MB
    kwargs = {"messages": CHAT, "chat_template_kwargs": {"x": list(range(1_000_000))}}
    chat_r, tokenize_r, kwargs_r = serve(
        tokenizer,
        [post("/v1/chat/completions", empties), post("/tokenize", empties),
         post("/v1/chat/completions", kwargs)],
    )  # fmt: skip
    for r in (chat_r, tokenize_r):
        assert r.status_code == 400
        assert message(r) == "messages: the body holds more than 65536 arrays and objects"
    assert kwargs_r.status_code == 400
    assert message(kwargs_r) == (
        "chat_template_kwargs: more than 4096 values (the limit for this field)"
    )


def test_a_body_past_a_limit_is_refused_before_the_rest_is_read(tokenizer):
    sent = []

    async def chunks():  # 10 MiB of {}s, chunked
        yield b'{"messages": ['
        for _ in range(40):
            sent.append(1)
            yield b"{}," * (2**18 // 3)
        yield b"{}]}"

    big = {"method": "POST", "url": "/tokenize", "content": chunks(),
           "headers": {"content-type": "application/json"}}  # fmt: skip
    (r,) = serve(tokenizer, [big])
    assert r.status_code == 400
    assert message(r) == "messages: the body holds more than 65536 arrays and objects"
    assert len(sent) < 40


def test_a_prompt_of_a_million_token_ids_passes_the_structure_limits(tokenizer):
    (r,) = serve(tokenizer, [post("/v1/completions", {"prompt": [1] * 1_000_000})])
    assert r.status_code == 400  # the stand-in model's max_model_len is 256
    assert "maximum context length is 256 tokens" in message(r)
    assert "1000000" in message(r)


# ---------------------------------------------------------------------- CORS, key, log
def preflight(origin: str) -> dict:
    headers = {"origin": origin, "access-control-request-method": "POST",
               "access-control-request-headers": "content-type,authorization"}  # fmt: skip
    return {"method": "OPTIONS", "url": "/v1/chat/completions", "headers": headers}


def test_no_cors_headers_unless_origins_are_allowed(tokenizer):
    simple = post("/v1/models", {}, headers={"origin": "https://evil.example"})
    simple["method"] = "GET"
    for r in serve(tokenizer, [preflight("https://evil.example"), simple]):
        assert "access-control-allow-origin" not in r.headers

    cors = {"allow_origins": ["https://ok.example"]}
    ok, evil, get = serve(
        tokenizer,
        [preflight("https://ok.example"), preflight("https://evil.example"),
         {**simple, "headers": {"origin": "https://ok.example"}}],
        cors=cors, api_key="sekrit",
    )  # fmt: skip
    assert ok.status_code == 200  # answered before the API key is asked for
    assert ok.headers["access-control-allow-origin"] == "https://ok.example"
    assert "access-control-allow-credentials" not in ok.headers
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    assert get.status_code == 401  # no key: CORS does not open the API
    assert get.headers["access-control-allow-origin"] == "https://ok.example"


def test_cors_flags_parse_as_json_lists_and_are_off_by_default():
    parse = build_parser().parse_args
    assert cors_settings(parse(["serve"])) is None
    args = parse(["serve", "--allowed-origins", '["https://a.example"]', "--allowed-methods",
                  '["POST"]', "--allow-credentials"])  # fmt: skip
    assert cors_settings(args) == {
        "allow_origins": ["https://a.example"], "allow_methods": ["POST"],
        "allow_headers": None, "allow_credentials": True,
    }  # fmt: skip
    with pytest.raises(SystemExit, match="--allowed-origins must be a JSON list of strings"):
        check_server_args(parse(["serve", "--allowed-origins", '"*"']))


@pytest.mark.parametrize("from_env", [False, True])
def test_the_start_up_log_line_never_holds_the_api_key(from_env):
    args = SimpleNamespace(host="0.0.0.0", port=8000, api_key=None if from_env else "sekrit-1")
    line = ready_message(args, "m", keyed=True)
    assert "sekrit" not in line
    placeholder = "$JAXSERVE_API_KEY" if from_env else "<your --api-key>"
    assert f'-H "Authorization: Bearer {placeholder}"' in line
    assert "Authorization" not in ready_message(args, "m", keyed=False)
    assert "curl http://localhost:8000/v1/chat/completions" in line


def test_detokenize_decodes_on_the_tokenizer_thread(tokenizer, monkeypatch):
    threads = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode",
                        lambda *a, **k: threads.append(threading.current_thread().name)
                        or decode(*a, **k))  # fmt: skip
    ids = tokenizer("Hello there").input_ids
    ok, bad = serve(tokenizer, [post("/detokenize", {"tokens": ids}),
                                post("/detokenize", {"tokens": [1, len(tokenizer)]})])  # fmt: skip
    assert ok.json() == {"prompt": "Hello there"}
    assert len(threads) == 1 and threads[0].startswith("jaxserve-tokenize")
    assert bad.status_code == 400 and "out of vocabulary" in message(bad)


# ---------------------------------------------------------------------- chat templates
def chat(**fields) -> dict:
    return post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **fields})


def test_a_request_chat_template_needs_the_trust_flag(tokenizer):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (refused,) = serve(tokenizer, [chat(chat_template=template)])
    assert refused.status_code == 400
    assert "--trust-request-chat-template is not set" in message(refused)
    (trusted,) = serve(tokenizer, [chat(chat_template=template)],
                       trust_request_chat_template=True)  # fmt: skip
    assert trusted.status_code == 200, trusted.text
    assert trusted.json()["usage"]["prompt_tokens"] == len(tokenizer("Hello").input_ids)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"chat_template": "{{ 1 }}"}, "Found unexpected chat template kwargs"),
        ({"tokenize": True}, "Found unexpected chat template kwargs"),
        ({"tools": "x"}, "may not set 'tools'"),
        ({"documents": [{"text": "x"}]}, "may not set 'documents'"),
        ({"bos_token": "EVIL"}, "may not set 'bos_token'"),
        ({"raise_exception": 1}, "may not set 'raise_exception'"),
        ({"enable_thinking": {"nested": True}}, "must be a string, number"),
        ({"builtin_tools": [["a"]]}, "must be a string, number"),
    ],
)
def test_chat_template_kwargs_must_be_plain_template_variables(tokenizer, kwargs, error):
    (r,) = serve(tokenizer, [chat(chat_template_kwargs=kwargs)])
    assert r.status_code == 400 and error in message(r)


def test_plain_chat_template_kwargs_reach_the_template(tokenizer):
    template = "{{ messages[0].content }} {{ greeting }} {{ flags | join(',') }}"
    plain = {"greeting": "hola", "flags": ["a", 1, True], "enable_thinking": False}
    (r,) = serve(tokenizer, [chat(chat_template=template, chat_template_kwargs=plain)],
                 trust_request_chat_template=True)  # fmt: skip
    assert r.status_code == 200, r.text
    text = "Hello hola a,1,True"
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer(text).input_ids)


def test_default_chat_template_kwargs_sit_under_the_requests(tokenizer):
    """--default-chat-template-kwargs reach the template of every chat request (and the
    chats /tokenize counts); a request's own chat_template_kwargs override them key by key."""
    template = "{{ messages[0].content }} {{ greeting }} {{ name }}"
    options = ServeOptions(default_chat_template_kwargs={"greeting": "hola", "name": "server"})
    body = {"messages": CHAT, "chat_template": template}
    own = {**body, "chat_template_kwargs": {"name": "client"}}
    r1, r2, r3 = serve(tokenizer, [chat(**body), chat(**own), post("/tokenize", own)],
                       options=options, trust_request_chat_template=True)  # fmt: skip
    assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
    for r, text in ((r1, "Hello hola server"), (r2, "Hello hola client")):
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer(text).input_ids)
    assert tokenizer.decode(r3.json()["tokens"]) == "Hello hola client"


def test_default_chat_template_kwargs_pass_the_request_checks():
    parse = build_parser().parse_args
    args = parse(["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    check_server_args(args)
    for bad, error in (({"tools": 1}, "may not set 'tools'"),
                       ({"x": {"nested": 1}}, "must be a string, number")):  # fmt: skip
        args = parse(["serve", "--default-chat-template-kwargs", json.dumps(bad)])
        with pytest.raises(SystemExit, match=f"--default-chat-template-kwargs: .*{error}"):
            check_server_args(args)


def test_a_runaway_template_fails_alone(tokenizer, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S", "2")
    plain = post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
    loops, plain_response, huge, after = serve(
        tokenizer,
        [chat(chat_template=NESTED_LOOPS), plain, chat(chat_template="{{ 'x' * 10**10 }}"),
         chat()],
        trust_request_chat_template=True,
    )  # fmt: skip
    assert loops.status_code == 400
    assert "did not finish rendering within 2 s" in message(loops)
    assert huge.status_code == 400 and "more than 1073741824 bytes of memory" in message(huge)
    assert plain_response.status_code == 200
    assert after.status_code == 200  # a fresh renderer took over


def test_a_slow_request_template_holds_up_no_other_chat(tokenizer, monkeypatch):
    """A plain chat sent while a trusted request's template is still rendering is answered
    before that render ends (the render waits for it: a stand-in for a template that runs
    for seconds; with renders taking turns, this would wait out the minute)."""
    slow_template = "{# slow #}{{ messages[0].content }}"
    started, plain_done = threading.Event(), threading.Event()
    render = TemplateRenderer.render

    def render_slowly(self, job, timeout_s):
        if job["template"] == slow_template:
            started.set()
            plain_done.wait(60)
        return render(self, job, timeout_s)

    monkeypatch.setattr(TemplateRenderer, "render", render_slowly)
    answered = []

    async def slow(client):
        r = await client.request(**chat(chat_template=slow_template))
        answered.append("slow")
        return r

    async def plain(client):
        await asyncio.to_thread(started.wait, 60)
        r = await client.request(**chat())
        answered.append("plain")
        plain_done.set()
        return r

    slow_r, plain_r = serve(tokenizer, [slow, plain], trust_request_chat_template=True)
    assert slow_r.status_code == 200 and plain_r.status_code == 200, (slow_r.text, plain_r.text)
    assert answered == ["plain", "slow"]


# ---------------------------------------------------------------------- memory
FREE_LARGE_BLOCKS = """
import re, sys
def rss_mib():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\\s+(\\d+)", f.read()).group(1)) // 1024
if sys.argv[1] == "set":
    from jaxserve.entrypoints.openai.server_setup import return_freed_memory
    assert return_freed_memory()
block = bytearray(8 << 20)
del block  # a large block freed: glibc raises its mmap threshold past 1 MiB
before, kept, large = rss_mib(), [], []
for _ in range(64):  # 1 MiB temporaries, each followed by a small block that outlives it
    large.append(bytearray(1 << 20))
    kept.append(bytearray(4096))
del large
print(rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator, /proc")
def test_the_server_process_returns_freed_large_blocks_to_the_system():
    """What serve_http sets up (server_setup.return_freed_memory): a request's large
    temporaries, freed, leave the process's memory; under glibc's default they stayed."""
    kept = {}
    for mode in ("default", "set"):
        run = subprocess.run([sys.executable, "-c", FREE_LARGE_BLOCKS, mode],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr
        kept[mode] = int(run.stdout)
    assert kept["default"] >= 32 and kept["set"] <= 8, kept
