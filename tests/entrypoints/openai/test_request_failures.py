"""Over HTTP, one request that fails (in the engine core, in the output processor or in its
serving handler) gets its error, a 500 with the message (an SSE error event when streamed),
while the requests sent beside it get their 200s and the server keeps serving. The app over
AsyncLLM and tests/engine/test_request_failures.py's stand-in core (no model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai import serving_completion
from jaxserve.entrypoints.openai.api_server import build_app
from tests.engine.test_request_failures import (
    CORE_ERROR,
    POISON,
    StepCore,
    expected_tokens,
    make_config,
    poisoned_detokenizer,  # noqa: F401 (a fixture)
    tokenizer,  # noqa: F401 (a fixture)
)


def body(i: int, first: int = 5, **extra) -> dict:
    return {"model": "m", "prompt": [first, 7, i], "max_tokens": 4 + i, **extra}


async def post_all(app, bodies: list[dict]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


@pytest.fixture
def app(tokenizer):  # noqa: F811
    core = StepCore()
    engine = AsyncLLM(make_config(tokenizer), core, tokenizer=tokenizer)
    app = build_app(engine, ["m"], log_stats_interval=None)
    yield app, core
    app.state.cpu.shutdown(wait=False)


def test_a_failing_request_gets_a_500_and_the_others_their_answers(
    app,
    tokenizer,  # noqa: F811
    poisoned_detokenizer,  # noqa: F811
    monkeypatch,
):
    app, core = app
    usage = serving_completion.OpenAIServingCompletion._usage

    def failing_usage(self, prompt_tokens, completion_tokens, cached):
        if completion_tokens == 4 + 6:  # request 6's serving handler fails
            raise KeyError("injected in the serving handler")
        return usage(self, prompt_tokens, completion_tokens, cached)

    monkeypatch.setattr(serving_completion.OpenAIServingCompletion, "_usage", failing_usage)
    bodies = [
        body(0),
        body(1, POISON),  # fails in the output processor
        body(2, stream=True),
        body(3, POISON + 1),  # fails in the engine core
        body(4),
        body(5, POISON + 1, stream=True),
        body(6),
    ]
    responses = asyncio.run(post_all(app, bodies))
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 500, 200, 500, 200, 200, 500]
    errors = {i: responses[i].json()["error"] for i in (1, 3, 6)}
    assert errors[1]["message"].endswith("injected in the detokenizer")
    assert errors[3]["message"].endswith(f"failed: {CORE_ERROR}")
    assert errors[6]["message"] == "'injected in the serving handler'"
    assert {e["type"] for e in errors.values()} == {"InternalServerError"}
    # a stream that fails: its error as the last event, then [DONE]
    events = [e.removeprefix("data: ") for e in responses[5].text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"].endswith(f"failed: {CORE_ERROR}")
    for i in (0, 4):
        (choice,) = responses[i].json()["choices"]
        assert choice["text"] == tokenizer.decode(expected_tokens(i, 4 + i))
        assert choice["finish_reason"] == "length"
    streamed = [json.loads(e.removeprefix("data: ")) for e in responses[2].text.split("\n\n")[:-2]]
    assert "".join(e["choices"][0]["text"] for e in streamed) == tokenizer.decode(
        expected_tokens(2, 6)
    )
    # every failed request left the core; the server keeps serving
    assert not core.live
    (again,) = asyncio.run(post_all(app, [body(0)]))
    assert again.status_code == 200 and not app.state.serving.engine.errored


def test_the_issues_kv_transfer_params_are_a_400_before_the_engine(app):
    app, core = app
    issue = {"do_remote_prefill": True, "remote_host": "x", "remote_port": "abc"}
    other_host = {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 14579}
    bad, elsewhere, ok = asyncio.run(post_all(app, [
        body(0, kv_transfer_params=issue), body(1, kv_transfer_params=other_host), body(2),
    ]))  # fmt: skip
    assert (bad.status_code, bad.json()["error"]["type"]) == (400, "BadRequestError")
    assert "at `$.remote_port`" in bad.json()["error"]["message"]
    assert elsewhere.status_code == 400
    assert "--kv-transfer-allowed-hosts" in elsewhere.json()["error"]["message"]
    assert ok.status_code == 200 and core.added == 1  # nothing else reached the core
