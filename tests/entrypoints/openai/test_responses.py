"""/v1/responses through the official openai client on the package's shared server (the default
model, --enable-auto-tool-choice --tool-call-parser hermes): text, both streaming helpers and
their event sequence, text.format, a function call round trip, 400s; and, in process over a
stand-in core (no model), the response store (JAXSERVE_ENABLE_RESPONSES_API_STORE) behind
previous_response_id and GET /v1/responses/{id}, and its bounds."""

from __future__ import annotations

import asyncio
import functools
import json
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest

from tests.require import import_or_skip

# Absent on the GPU machine: skip, collect cleanly (CI fails instead: tests/require.py).
openai = import_or_skip("openai")
jsonschema = import_or_skip("jsonschema")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from jaxserve.engine.async_llm import AsyncLLM  # noqa: E402
from jaxserve.entrypoints.openai.api_server import build_app  # noqa: E402
from jaxserve.entrypoints.openai.protocol_responses import ResponsesResponse  # noqa: E402
from jaxserve.entrypoints.openai.responses_store import (  # noqa: E402
    ResponsesStore,
    StoredResponse,
    entry_size,
)
from tests.engine.test_request_failures import (  # noqa: E402
    CORE_ERROR,
    make_config,
    tokenizer,  # noqa: F401 (a fixture)
)
from tests.entrypoints.openai.test_api_server import KEY, MODEL  # noqa: E402
from tests.entrypoints.openai.test_protocol_mapping import LogprobCore  # noqa: E402
from tests.entrypoints.openai.test_structured_outputs import WEATHER  # noqa: E402
from tests.entrypoints.test_llm import PERSON  # noqa: E402

slow = pytest.mark.slow
ASK = "What is the capital of France?"
RULES = "You are a terse geography teacher."
# The Responses API's flat function tool
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
EVENTS = TypeAdapter(ResponseStreamEvent)


def without_ids(response) -> dict:
    """A response's outcome: its output (ids, call ids and the stream helper's `parsed`
    aside), status and usage (but the prefix cache's part: a second run of a prompt finds
    the first's blocks)."""
    output = []
    for item in response.output:
        item = {k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")}
        for part in item.get("content") or ():
            part.pop("parsed", None)
        output.append(item)
    usage = response.usage.model_dump(exclude={"input_tokens_details"})
    return {"output": output, "status": response.status, "usage": usage}


# ---------------------------------------------------------------------- on the server
@slow
def test_text_response_is_the_chat_answer_and_parses_as_openais_response(client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, input=ASK, instructions=RULES, temperature=0, max_output_tokens=24,
        metadata={"k": "v"}, user="u1",
    )  # fmt: skip
    response = Response.model_validate(raw.http_response.json())  # every required field
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": RULES}, {"role": "user", "content": ASK}],
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.model, response.metadata, response.user) == (MODEL, {"k": "v"}, "u1")
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert response.output_text == chat.choices[0].message.content  # the same prompt
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == {"stop": "completed", "length": "incomplete"}[finished]
    short = client.responses.create(model=MODEL, input="Tell me a long story.",
                                    max_output_tokens=3, temperature=0)  # fmt: skip
    assert short.status == "incomplete" and short.usage.output_tokens == 3
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.store is False  # the shared server has no store: echoed false


@slow
def test_both_streaming_helpers_give_the_non_streamed_response(client):
    kwargs = dict(model=MODEL, input=ASK, instructions=RULES, temperature=0, max_output_tokens=20)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    for e in events:  # each one OpenAI's event shape
        EVENTS.validate_python(e.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    item_id = events[2].item.id
    for e in events[4 : 4 + deltas]:
        assert (e.item_id, e.output_index, e.content_index) == (item_id, 0, 0)
    text = "".join(e.delta for e in events[4 : 4 + deltas])
    assert text == events[-4].text == whole.output_text
    assert events[-2].item.id == item_id == events[-1].response.output[0].id
    assert without_ids(events[-1].response) == without_ids(whole)
    with client.responses.stream(**kwargs) as stream:
        helped = [e.type for e in stream]
        final = stream.get_final_response()
    assert helped == kinds and without_ids(final) == without_ids(whole)


@slow
def test_text_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    with ThreadPoolExecutor(2) as pool:  # both at once (one batch), each checked alone
        schema = pool.submit(
            client.responses.create,
            model=MODEL,
            input="Describe a person as JSON.",
            temperature=0,
            max_output_tokens=200,
            text={"format": fmt},
        )
        obj = pool.submit(
            client.responses.create,
            model=MODEL,
            input='Reply with {"answer": 2 + 2} as JSON.',
            temperature=0,
            max_output_tokens=120,
            text={"format": {"type": "json_object"}},
        )
        r = schema.result()
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), PERSON)
        assert r.text.format.type == "json_schema" and r.text.format.name == "person"
        r = obj.result()
    assert r.status == "completed", r.output_text
    assert isinstance(json.loads(r.output_text), dict)


@slow
def test_function_call_round_trip_matches_chat(client):
    params = FLAT_WEATHER["parameters"]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "name": "get_weather"}
    kwargs = dict(
        model=MODEL,
        input=ask,
        tools=[FLAT_WEATHER],
        tool_choice=named,
        temperature=0,
        max_output_tokens=100,
    )
    with ThreadPoolExecutor(1) as pool:  # the whole response beside the stream (one batch)
        whole = pool.submit(client.responses.create, **kwargs)
        # streamed: the arguments' deltas make the same call
        events = list(client.responses.create(**kwargs, stream=True))
        call_response = whole.result()
    (call,) = call_response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), params)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == call.arguments
    # the call and its output as the next turn's input: chat's prompt with the same history
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow_up = [*ask, call.model_dump(exclude_none=True), result]
    with ThreadPoolExecutor(1) as pool:  # beside the chat request (one batch)
        answered = pool.submit(
            client.responses.create,
            model=MODEL,
            input=follow_up,
            tools=[FLAT_WEATHER],
            temperature=0,
            max_output_tokens=30,
        )
        chat = client.chat.completions.create(
            model=MODEL,
            tools=[WEATHER],
            temperature=0,
            max_tokens=30,
            messages=[
                *ask,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
            ],
        )
        answer = answered.result()
    message = chat.choices[0].message
    expected = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    assert answer.output_text == (message.content or "")
    assert [(i.name, i.arguments) for i in answer.output if i.type == "function_call"] == expected
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


@slow
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": []}, "input must not be empty"),
        ({"input": 5}, "`$.input`"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type must be message, function_call"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role must be one of"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
         "input[0].content[0] must be an input_text"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id must be a non-empty string"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"tools": [FLAT_WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "'nope', which is not in tools"),
        ({"tool_choice": {"type": "mcp"}}, "Invalid enum value 'mcp' - at `$.tool_choice.type`"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}},
         "missing required field `schema` - at `$.text.format`"),
        ({"text": {"format": {"type": "yaml"}}}, "Invalid value 'yaml' - at `$.text.format.type`"),
        ({"max_output_tokens": 0}, "max_output_tokens must be at least 1"),
        ({"reasoning": {"effort": "extreme"}}, "'extreme' - at `$.reasoning.effort`"),
        ({"background": True}, "background is not supported"),
        ({"truncation": "auto"}, 'truncation must be "disabled"'),
        ({"model": "nope"}, "nope"),
        ({"previous_response_id": "resp_1"}, "JAXSERVE_ENABLE_RESPONSES_API_STORE"),
        # input_image takes chat's image path: this text-only model takes no images
        ({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://127.0.0.1:9/x.png"}]}]},
         "At most 0 image(s) may be provided in one prompt."),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_value(server, body, message):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.url}/v1/responses", headers=headers, timeout=30,
                   json={"model": MODEL, "input": "hi", **body})  # fmt: skip
    status = 404 if body.get("model") == "nope" else 400
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == status
    if body.get("previous_response_id"):
        got = httpx.get(f"{server.url}/v1/responses/resp_1", headers=headers, timeout=30)
        assert got.status_code == 400
        assert "JAXSERVE_ENABLE_RESPONSES_API_STORE" in got.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------- in process: the store
@pytest.fixture
def serve(tokenizer, monkeypatch):  # noqa: F811
    """serve(store, output, reasoning_parser): the app over a stand-in core answering
    `output` to everything (no model), with the response store on or off."""
    apps = []

    def make(store: bool, output: str | None = " Paris.", reasoning_parser: str | None = None,
             core_cls: type = LogprobCore):  # fmt: skip
        """output None: the stand-in's one token, with its logprobs."""
        monkeypatch.setenv("JAXSERVE_ENABLE_RESPONSES_API_STORE", "1" if store else "0")
        core = core_cls()
        if output is not None:
            core.output = tokenizer(output, add_special_tokens=False).input_ids
        config = make_config(tokenizer)
        config.reasoning_parser = reasoning_parser
        engine = AsyncLLM(config, core, tokenizer=tokenizer)
        apps.append(build_app(engine, ["m"], log_stats_interval=None))
        return apps[-1], core

    yield make
    for app in apps:
        app.state.cpu.shutdown(wait=False)


def sse_events(text: str) -> list:
    """A Responses stream's events, each checked against OpenAI's event types (and its
    `event:` line against its type)."""
    events = []
    for block in filter(None, text.split("\n\n")):
        kind, data = block.split("\n")
        events.append(EVENTS.validate_json(data.removeprefix("data: ")))
        assert kind == f"event: {events[-1].type}"
    return events


def exchange(app, calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    """The (method, path, body) calls in order, in one event loop."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.request(m, p, json=b) for m, p, b in calls]

    try:
        return asyncio.run(main())
    finally:
        if app.state.serving.engine.output_handler is not None:
            app.state.serving.engine.output_handler.cancel()


def test_previous_response_id_continues_the_stored_conversation(serve, tokenizer):  # noqa: F811
    app, core = serve(store=True)
    first = {"input": "Capital of France?", "instructions": "Be brief.", "max_output_tokens": 5}
    (r1,) = exchange(app, [("POST", "/v1/responses", first)])
    rid = r1.json()["id"]
    assert (
        r1.json()["store"] is True and Response.model_validate(r1.json()).output_text == " Paris."
    )
    follow = {"input": "And of Spain?", "instructions": "Answer in French.",
              "previous_response_id": rid, "stream": True}  # fmt: skip
    not_kept = {"input": "x", "store": False}
    r2, got, missing, unknown, r3 = exchange(app, [
        ("POST", "/v1/responses", follow), ("GET", f"/v1/responses/{rid}", None),
        ("GET", "/v1/responses/resp_nope", None),
        ("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}),
        ("POST", "/v1/responses", not_kept),
    ])  # fmt: skip
    prompt = tokenizer.decode(core.requests[1].prompt_token_ids)
    # the earlier input and output, then the new input; only the new instructions
    turns = ["Answer in French.", "Capital of France?", "assistant\n Paris.", "And of Spain?"]
    assert [prompt.index(t) for t in turns] == sorted(prompt.index(t) for t in turns)
    assert "Be brief." not in prompt
    completed = sse_events(r2.text)[-1].response
    assert completed.previous_response_id == rid
    assert got.status_code == 200 and got.json() == r1.json()
    for r in (missing, unknown):
        assert r.status_code == 404 and r.json()["error"] == {
            "message": "Response with id 'resp_nope' not found.", "type": "NotFoundError",
            "code": 404, "param": None,
        }  # fmt: skip
    assert r3.json()["store"] is False
    (again,) = exchange(app, [("GET", f"/v1/responses/{r3.json()['id']}", None)])
    assert again.status_code == 404  # store: false is not kept
    # a streamed response is kept too, and a chain of them carries every turn
    third = {"input": "And of Italy?", "previous_response_id": completed.id}
    got, r4 = exchange(app, [("GET", f"/v1/responses/{completed.id}", None),
                             ("POST", "/v1/responses", third)])  # fmt: skip
    assert Response.model_validate(got.json()) == completed and r4.status_code == 200
    prompt = tokenizer.decode(core.requests[-1].prompt_token_ids)
    turns = ["Capital of France?", " Paris.", "And of Spain?", " Paris.", "And of Italy?"]
    at = 0
    for turn in turns:
        at = prompt.index(turn, at) + len(turn)
    assert "Answer in French." not in prompt


def test_without_the_store_store_true_is_accepted_and_continuing_is_a_400(serve):
    app, core = serve(store=False)
    ok, bad = exchange(app, [
        ("POST", "/v1/responses", {"input": "hi", "store": True, "max_output_tokens": 3}),
        ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}),
    ])  # fmt: skip
    assert ok.status_code == 200 and ok.json()["store"] is False
    assert bad.status_code == 400 and "JAXSERVE_ENABLE_RESPONSES_API_STORE=1" in bad.text
    assert len(core.requests) == 1  # the refused request reached no engine


def stored(history: list) -> StoredResponse:
    return StoredResponse(ResponsesResponse(id="resp_x", created_at=0, model="m", output=[]),
                          history)  # fmt: skip


def test_the_store_is_bounded_in_entries_and_bytes_least_recently_used_first():
    def entry(size: int) -> StoredResponse:
        return stored([{"role": "user", "content": "a" * size}])

    small = entry_size("a", msgspec.json.encode(entry(10)))
    store = ResponsesStore(max_entries=2, max_bytes=2 * small + 10)
    store.put("a", entry(10))
    store.put("b", entry(10))
    assert store.get("a") == entry(10)  # a is now the most recently used
    store.put("c", entry(10))  # a third entry: b goes
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    store.put("d", entry(10 + small))  # over a small one's size: c and a go (c was older)
    assert store.get("d") == entry(10 + small) and len(store) == 1
    assert store.nbytes == entry_size("d", msgspec.json.encode(entry(10 + small)))
    store.put("e", entry(10 + 3 * small))  # larger than the whole store: not kept
    assert store.get("e") is None and store.get("d") is not None


def test_the_memory_the_store_holds_stays_within_its_cap():
    """Entries of many tiny objects (10,000 `{}` in an input item: 30 KB of JSON, 0.7 MB as
    Python objects): what the store holds after 30 of them, as tracemalloc counts it, stays
    within its 256 KiB cap, and its count is at least what it holds. (Held as the objects,
    8 such entries took 5.8 MB.)"""
    cap = 2**18
    store = ResponsesStore(max_bytes=cap)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(30):
            item = {"role": "user", "content": "hi", "x": [{} for _ in range(10_000)]}
            store.put(f"resp_{i}", stored([item]))
        del item
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 4 < len(store) < 30 and store.nbytes <= cap
    assert held <= store.nbytes + 16 * 1024  # (the interpreter keeps up to 80 freed dicts)
    last = store.get("resp_29")
    assert last.history[0]["x"] == [{}] * 10_000 and last.response.id == "resp_x"


def test_free_form_settings_are_bounded_with_400s_naming_them(serve):
    app, core = serve(store=False)
    too_many = {str(i): "v" for i in range(17)}
    bad = [
        ({"metadata": too_many}, "Expected `object` of length <= 16 - at `$.metadata`"),
        ({"metadata": {"k" * 65: "v"}}, "length <= 64 - at `key` in `$.metadata`"),
        ({"metadata": {"k": "v" * 513}}, "length <= 512 - at `$.metadata[...]`"),
        ({"metadata": {"k": [{}]}}, "Expected `str`, got `array` - at `$.metadata[...]`"),
        ({"reasoning": {"summary": 5}}, "Expected `str | null`, got `int` - at "
         "`$.reasoning.summary`"),
        ({"reasoning": {"effort": "low", "x": [{}]}}, "unknown field `x` - at `$.reasoning`"),
        ({"text": {"format": {"type": "text", "x": [{}]}}}, "unknown field `x` - at "
         "`$.text.format`"),
        ({"text": {"x": [{}]}}, "unknown field `x` - at `$.text`"),
        ({"tool_choice": {"type": "function", "name": "f", "x": [{}]}},
         "unknown field `x` - at `$.tool_choice`"),
        ({"service_tier": "x" * 100}, "at `$.service_tier`"),
        ({"input": [{"type": "reasoning", "summary": 5}]},
         'input[0].summary must be a list of parts ({"type", "text"}), got 5'),
        ({"input": [{"type": "reasoning", "content": [{"text": 5}]}]},
         "input[0].content must be a list of parts"),
    ]  # fmt: skip
    calls = [("POST", "/v1/responses", {"input": "hi", **body}) for body, _ in bad]
    for r, (_, message) in zip(exchange(app, calls), bad, strict=True):
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert not core.requests  # none reached the engine
    at_the_bounds = {
        "metadata": {f"{i:064d}": "v" * 512 for i in range(16)},
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "json_object"}, "verbosity": "low"},
        "service_tier": "flex",
        "input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hm."}]},
                  {"role": "user", "content": "hi"}],
    }  # fmt: skip
    (ok,) = exchange(app, [("POST", "/v1/responses", at_the_bounds)])
    assert ok.status_code == 200, ok.text
    response = Response.model_validate(ok.json())
    assert response.metadata == at_the_bounds["metadata"]
    assert response.reasoning.summary == "auto" and response.service_tier == "flex"


def test_reasoning_comes_first_as_a_reasoning_item_whole_and_streamed(serve):
    app, _ = serve(False, "Sunny means Paris.</think> Paris.", reasoning_parser="deepseek_r1")
    body = {"input": "Capital of France?", "max_output_tokens": 30}
    calls = [("POST", "/v1/responses", body), ("POST", "/v1/responses", {**body, "stream": True})]
    whole, streamed = exchange(app, calls)
    response = Response.model_validate(whole.json())
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == ["Sunny means Paris."]
    assert message.type == "message" and response.output_text == " Paris."
    events = sse_events(streamed.text)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.output_index for e in events[2:-1]] == [0] * 6 + [1] * 6
    assert without_ids(events[-1].response) == without_ids(response)  # usage too
    usage = response.usage
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens


class FailingCore(LogprobCore):
    """Every request fails in the engine core."""

    def add_requests(self, requests) -> None:
        super().add_requests(requests)
        for out in self.pending:
            out.new_token_ids, out.finish_reason, out.stop_reason = [], "error", CORE_ERROR


def test_an_engine_failure_is_a_500_or_the_streams_last_event(serve):
    app, _ = serve(False, core_cls=FailingCore)
    body = {"input": "hi", "max_output_tokens": 5}
    calls = [("POST", "/v1/responses", body), ("POST", "/v1/responses", {**body, "stream": True})]
    whole, streamed = exchange(app, calls)
    assert whole.status_code == 500 and whole.json()["error"]["message"].endswith(CORE_ERROR)
    events = sse_events(streamed.text)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1].message.endswith(CORE_ERROR) and events[-1].sequence_number == 2
    assert not app.state.serving.engine.errored


# ---------------------------------------------------------------------- in process: vLLM's fields
def with_openai(app, *calls):
    """Each call(client) in order, with the official async client over the app (in process);
    their results."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http,
                                        max_retries=0)  # fmt: skip
            return [await call(client) for call in calls]

    try:
        return asyncio.run(main())
    finally:
        if app.state.serving.engine.output_handler is not None:
            app.state.serving.engine.output_handler.cancel()


async def streamed(stream) -> list:
    return [event async for event in await stream]


def test_effort_none_and_empty_tools_are_accepted_as_vllm_does(serve):
    """reasoning.effort "none" turns the template's thinking off (Qwen3's parser then reads
    the answer as text, not reasoning); tools [] is no tools (tool_choice echoed none); a
    call asked for without tools is a 400 in vLLM's words."""
    app, core = serve(False, reasoning_parser="qwen3")
    ask = {"model": "m", "input": "Capital of France?", "max_output_tokens": 5}
    none, low, stream = with_openai(
        app,
        lambda c: c.responses.create(**ask, reasoning={"effort": "none"}, tools=[]),
        lambda c: c.responses.create(**ask, reasoning={"effort": "low"}, tool_choice="auto"),
        lambda c: streamed(c.responses.create(**ask, reasoning={"effort": "low"}, tools=[],
                                              stream=True)),
    )  # fmt: skip
    assert [item.type for item in none.output] == ["message"] and none.output_text == " Paris."
    assert none.reasoning.effort == "none" and (none.tools, none.tool_choice) == ([], "none")
    assert [item.type for item in low.output] == ["reasoning"]  # thinking on: all reasoning
    assert low.tool_choice == "none"
    reasoning = [r.usage.output_tokens_details.reasoning_tokens for r in (none, low)]
    assert reasoning == [0, low.usage.output_tokens]
    assert stream[-1].type == "response.completed" and stream[-1].response.reasoning.effort == "low"
    assert "reasoning_text" in [getattr(e.part, "type", None) for e in stream if e.type.endswith(
        "content_part.added")]  # fmt: skip
    bad = [({"tool_choice": "required", "tools": []},
            "Tool choice 'required' must be specified with 'tools' parameter."),
           ({"tool_choice": {"type": "function", "name": "f"}},
            "Tool choice 'function' not found in 'tools' parameter.")]  # fmt: skip
    answers = exchange(app, [("POST", "/v1/responses", {"input": "hi", **b}) for b, _ in bad])
    for r, (_, message) in zip(answers, bad, strict=True):
        assert r.status_code == 400 and r.json()["error"]["message"] == message
    assert len(core.requests) == 3


def test_enable_response_messages_returns_the_raw_prompt_and_output(serve, tokenizer):  # noqa: F811
    app, core = serve(False)
    ask = {"model": "m", "input": "Capital of France?", "max_output_tokens": 5}
    shown = {"extra_body": {"enable_response_messages": True}}
    whole, stream, plain = with_openai(
        app,
        lambda c: c.responses.create(**ask, **shown),
        lambda c: streamed(c.responses.create(**ask, **shown, stream=True)),
        lambda c: c.responses.create(**ask),
    )
    for response, request in ((whole, core.requests[0]), (stream[-1].response, core.requests[1])):
        (prompt,) = response.input_messages
        assert prompt["type"] == "raw_message_tokens"
        assert prompt["tokens"] == list(request.prompt_token_ids)
        assert prompt["message"] == tokenizer.decode(request.prompt_token_ids)
        assert "Capital of France?" in prompt["message"]
        assert response.output_messages == [
            {"type": "raw_message_tokens", "message": " Paris.", "tokens": core.output}
        ]
    assert plain.input_messages is None and plain.output_messages is None  # null, present


# vLLM 0.32.0's ResponsesResponse, as model_dump(mode="json") writes it (nulls included)
VLLM_RESPONSE_FIELDS = {
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object",
    "output", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p",
    "background", "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt",
    "reasoning", "service_tier", "status", "text", "top_logprobs", "truncation", "usage", "user",
    "presence_penalty", "frequency_penalty", "kv_transfer_params", "ec_transfer_params",
    "input_messages", "output_messages",
}  # fmt: skip
VLLM_USAGE_DETAILS = {
    "input_tokens_details": {"cached_tokens", "cache_write_tokens", "input_tokens_per_turn",
                             "cached_tokens_per_turn"},
    "output_tokens_details": {"reasoning_tokens", "tool_output_tokens", "output_tokens_per_turn",
                              "tool_output_tokens_per_turn"},
}  # fmt: skip


def test_response_fields_are_vllms_with_the_settings_the_engine_ran(serve):
    """Every field vLLM's response has (nulls too), and OpenAI's error and store beside them;
    the sampling settings as the engine ran them (defaults filled in, as vLLM echoes them);
    chat's sampling fields reach the engine."""
    app, core = serve(False)
    body = {"input": "hi", "reasoning": {"effort": "low"}, "repetition_penalty": 1.3,
            "stop": ["x"], "min_p": 0.1, "max_tool_calls": 2}  # fmt: skip
    (r,) = exchange(app, [("POST", "/v1/responses", body)])
    got = r.json()
    assert set(got) - VLLM_RESPONSE_FIELDS == {"error", "store"}
    assert set(got) >= VLLM_RESPONSE_FIELDS
    for field, keys in VLLM_USAGE_DETAILS.items():
        assert set(got["usage"][field]) == keys
    assert got["reasoning"] == {"context": None, "effort": "low", "generate_summary": None,
                                "mode": None, "summary": None}  # fmt: skip
    prompt_tokens = len(core.requests[0].prompt_token_ids)
    assert (got["temperature"], got["top_p"], got["presence_penalty"]) == (1.0, 1.0, 0.0)
    assert got["max_output_tokens"] == 256 - prompt_tokens  # the room the context leaves
    assert (got["max_tool_calls"], got["top_logprobs"], got["input_messages"]) == (2, None, None)
    params = core.requests[0].sampling_params
    assert (params.repetition_penalty, params.stop, params.min_p) == (1.3, ["x"], 0.1)


def test_cache_usage_and_logprobs_when_included(serve):
    """usage.input_tokens_details: the prompt tokens read from the prefix cache (the
    engine's count) and those written to it (its full 16-token blocks less those read),
    without --enable-prompt-tokens-details as in vLLM; include's output_text logprobs, whole
    and with each streamed delta."""
    app, core = serve(False, output=None, core_cls=functools.partial(LogprobCore, cached=16))
    logprobs = {
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 1,
        "extra_body": {"skip_special_tokens": False},
    }  # its token: <gh_stars>
    whole, stream = with_openai(
        app,
        lambda c: c.responses.create(model="m", input="hi", **logprobs),
        lambda c: streamed(c.responses.create(model="m", input="hi", stream=True, **logprobs)),
    )
    prompt_tokens = len(core.requests[0].prompt_token_ids)
    details = whole.usage.input_tokens_details
    assert prompt_tokens > 16 and details.cached_tokens == 16
    assert details.cache_write_tokens == prompt_tokens // 16 * 16 - 16
    (text,) = whole.output[0].content
    (lp,) = text.logprobs
    assert lp.logprob == -0.5 and [t.logprob for t in lp.top_logprobs] == [-0.5]
    assert lp.token == text.text and whole.top_logprobs == 1
    (delta,) = [e for e in stream if e.type == "response.output_text.delta"]
    assert [x.model_dump() for x in delta.logprobs] == [lp.model_dump()]
    assert stream[-1].response.output[0].content[0].logprobs == text.logprobs
    assert core.requests[0].sampling_params.logprobs == 1
