"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the official
`anthropic` client against the package's shared server (conftest.py: the default model,
--enable-auto-tool-choice --tool-call-parser hermes, API key KEY), in process over a stand-in
engine core (usage, output_config, vLLM's fields), and the request mapping onto the chat path
without a server. Sampling is greedy (temperature 0, which this client version sends through
extra_body: its create() has no temperature argument)."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.protocol_anthropic import MessagesRequest, to_chat_request
from jaxserve.entrypoints.openai.request_body import RequestTooLarge
from jaxserve.entrypoints.openai.serving_messages import anthropic_error_response
from tests.require import import_or_skip

anthropic = import_or_skip("anthropic")  # in the test extra (fails in CI when missing)

from tests.engine.test_request_failures import make_config  # noqa: E402
from tests.entrypoints.openai.test_api_server import KEY, MODEL  # noqa: E402
from tests.entrypoints.openai.test_protocol_mapping import (  # noqa: E402
    LogprobCore,
    tokenizer,  # noqa: F401 (a fixture)
)

GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"], "additionalProperties": False},
}  # fmt: skip
FORCED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def create(client, **kwargs):
    fields = {"model": MODEL, "max_tokens": 20, "messages": QUESTION, "extra_body": GREEDY}
    return client.messages.create(**{**fields, **kwargs})


def raw_events(server, body: dict, key: str = KEY) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed /v1/messages, read as plain SSE."""
    body = {"model": MODEL, "stream": True, **GREEDY, **body}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body,
                      headers={"x-api-key": key}, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert len(names) == len(data), lines
    return list(zip(names, data, strict=True))


def comparable(message) -> dict:
    """A message without its ids (fresh per response)."""
    out = message.model_dump(exclude={"id"})
    for block in out["content"]:
        block.pop("id", None)
    return out


@pytest.mark.slow
def test_text_message_streams_as_it_is_whole(client):
    whole = create(client, system="Be brief.")
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and whole.stop_reason == "end_turn" and whole.stop_sequence is None
    assert [b.type for b in whole.content] == ["text"] and "Paris" in whole.content[0].text
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens < 20

    with client.messages.stream(model=MODEL, max_tokens=20, messages=QUESTION,
                                system="Be brief.", extra_body=GREEDY) as stream:  # fmt: skip
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text
    assert comparable(final) == comparable(whole)

    events = list(create(client, system="Be brief.", stream=True))
    kinds = [e.type for e in events]
    n = len(kinds) - 5  # the text deltas
    assert n >= 1 and kinds == ["message_start", "content_block_start",
                                *["content_block_delta"] * n, "content_block_stop",
                                "message_delta", "message_stop"]  # fmt: skip
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.output_tokens == 0
    assert start.usage.input_tokens == whole.usage.input_tokens
    assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert "".join(e.delta.text for e in events[2 : 2 + n]) == whole.content[0].text
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens


@pytest.mark.slow
def test_stop_sequence_and_max_tokens(client):
    stopped = create(client, stop_sequences=["Paris", "Berlin"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert stopped.content[0].text == "The capital of France is "  # cut before the match
    with client.messages.stream(model=MODEL, max_tokens=20, messages=QUESTION,
                                stop_sequences=["Paris"], extra_body=GREEDY) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"
    assert final.content[0].text == stopped.content[0].text

    cut = create(client, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None
    assert cut.usage.output_tokens == 3


@pytest.mark.slow
def test_tool_use_round_trip(client, server):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = create(client, max_tokens=30, messages=asked, tools=[WEATHER], tool_choice=FORCED)
    assert call.stop_reason == "tool_use" and [b.type for b in call.content] == ["tool_use"]
    use = call.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert isinstance(use.input, dict) and isinstance(use.input["city"], str)

    # Streamed: the arguments as input_json_delta pieces, in named events, a ping first.
    events = raw_events(server, {"max_tokens": 30, "messages": asked, "tools": [WEATHER],
                                 "tool_choice": FORCED})  # fmt: skip
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["input"] == {} and block["id"].startswith("toolu_")
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert len(deltas) > 1 and all(d["type"] == "input_json_delta" for d in deltas)
    assert json.loads("".join(d["partial_json"] for d in deltas)) == use.input
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    with client.messages.stream(model=MODEL, max_tokens=30, messages=asked, tools=[WEATHER],
                                tool_choice=FORCED, extra_body=GREEDY) as stream:  # fmt: skip
        assert comparable(stream.get_final_message()) == comparable(call)

    # The answer goes back as a tool_result; the model answers in text.
    result = {"type": "tool_result", "tool_use_id": use.id,
              "content": [{"type": "text", "text": "sunny, 21 C"}]}  # fmt: skip
    turns = [*asked, {"role": "assistant", "content": call.content},
             {"role": "user", "content": [result]}]  # fmt: skip
    answer = create(client, messages=turns, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens > call.usage.input_tokens


@pytest.mark.slow
def test_output_config_json_schema_constrains_the_answer(client):
    """vLLM's test_anthropic_structured_output, on the default model."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    answer = create(client, max_tokens=40, output_config=fmt)
    assert answer.stop_reason == "end_turn"
    assert json.loads(answer.content[0].text) == {"city": "Paris"}


@pytest.mark.slow
def test_count_tokens_is_the_rendered_prompt(client, tokenizer):  # noqa: F811 (the server's)
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=QUESTION)
    chat = [{"role": "system", "content": "Be brief.\nBe kind."}, *QUESTION]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    expected = len(tokenizer(text, add_special_tokens=False).input_ids)
    assert counted.input_tokens == expected
    whole = create(client, system=system, max_tokens=1)
    assert whole.usage.input_tokens == expected


@pytest.mark.slow
def test_errors_in_anthropic_shape(client, server):
    def refused(error_cls, body: dict, status: int, kind: str, *named: str):
        with pytest.raises(error_cls) as e:
            client.post("/v1/messages", body=body, cast_to=object)
        assert e.value.status_code == status
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == kind
        for word in named:
            assert word in e.value.body["error"]["message"]

    bad = anthropic.BadRequestError
    refused(bad, {"model": MODEL, "messages": QUESTION}, 400, "invalid_request_error",
            "max_tokens")  # fmt: skip
    robot = [{"role": "robot", "content": "hi"}]
    refused(bad, {"model": MODEL, "max_tokens": 5, "messages": robot}, 400,
            "invalid_request_error", "messages[0].role", "'robot'")  # fmt: skip
    refused(anthropic.NotFoundError, {"model": "claude-nope", "max_tokens": 5,
            "messages": QUESTION}, 404, "not_found_error", "claude-nope")  # fmt: skip
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}  # fmt: skip
    pictured = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
    refused(bad, {"model": MODEL, "max_tokens": 5, "messages": pictured}, 400,
            "invalid_request_error", "At most 0 image(s)")  # fmt: skip
    with pytest.raises(bad, match="tool_choice"):
        create(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(bad, match="messages"):  # count_tokens answers in the same shape
        client.messages.count_tokens(model=MODEL, messages=[])


@pytest.mark.slow
def test_api_key_as_anthropic_clients_send_it(client, server):
    assert create(client, max_tokens=1).usage.output_tokens == 1  # x-api-key: KEY
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        create(wrong, max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    body = {"model": MODEL, "messages": QUESTION}
    url = f"{server.url}/v1/messages/count_tokens"
    bearer = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    # x-api-key is the Messages API's; the OpenAI routes still ask for the Bearer token
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 401


# ---------------------------------------------------------------------- no server
def test_messages_map_onto_a_chat_conversation():
    body = MessagesRequest(
        model="m", max_tokens=7, stop_sequences=["END"], temperature=0.5, top_k=3,
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "http://x/cat.png"}}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom",
                 "is_error": True},
                {"type": "text", "text": "and now?"}]},
            {"role": "assistant", "content": "It is"},
        ],
    )  # fmt: skip
    chat = to_chat_request(body)
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k) == (7, ["END"], 0.5, 3)
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    system, user, assistant, tool, user2, prefill = chat.messages
    assert system == {"role": "system", "content": "a\nb"}
    assert user["content"][0] == {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    assert assistant["content"] == [{"type": "text", "text": "calling"}]
    assert assistant["reasoning"] == "hmm"
    assert assistant["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]  # fmt: skip
    # the tool's answer right after the call; the rest of that user turn after it
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: boom"}
    assert user2 == {"role": "user", "content": [{"type": "text", "text": "and now?"}]}
    # a final assistant turn is continued (Anthropic's prefill), not answered
    assert prefill == {"role": "assistant", "content": "It is"}
    assert chat.continue_final_message and not chat.add_generation_prompt

    named = MessagesRequest(max_tokens=1, messages=[], tool_choice=FORCED)
    assert to_chat_request(named).tool_choice == {"type": "function",
                                                  "function": {"name": "get_weather"}}  # fmt: skip
    image64 = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                           "data": "AAAA"}}  # fmt: skip
    one = to_chat_request(MessagesRequest(max_tokens=1, messages=[
        {"role": "user", "content": [image64]}]))  # fmt: skip
    assert one.messages[0]["content"][0]["image_url"]["url"] == "data:image/jpeg;base64,AAAA"
    assert one.add_generation_prompt and not one.continue_final_message


@pytest.mark.parametrize(
    "messages, named",
    [
        ([{"role": "system", "content": "x"}], ["messages[0].role", "'system'"]),
        ([{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}],
         ["messages[0].content[0]", "tool_use"]),
        ([{"role": "assistant", "content": [{"type": "image", "source": {}}]}],
         ["messages[0].content[0]", "image"]),
        ([{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}],
         ["messages[0].content[0].source", "'file'"]),
        ([{"role": "user", "content": [{"type": "document"}]}], ["'document'"]),
        ([{"role": "user", "content": 5}], ["messages[0].content", "int"]),
    ],
)  # fmt: skip
def test_bad_blocks_are_named(messages, named):
    with pytest.raises(ValueError) as e:
        to_chat_request(MessagesRequest(max_tokens=1, messages=messages))
    for word in named:
        assert word in str(e.value)


def test_error_statuses():
    for error, status, kind in [
        (ValueError("bad"), 400, "invalid_request_error"),
        (RequestTooLarge("big"), 413, "request_too_large"),
        (EngineDeadError(), 500, "api_error"),
    ]:
        response = anthropic_error_response(error)
        assert response.status_code == status
        body = json.loads(response.body)
        assert body == {"type": "error", "error": {"type": kind, "message": str(error)}}


def test_deltas_become_content_block_events():
    """Reasoning, text and two tool calls of one streamed choice: a block per kind, the
    calls' argument pieces as input_json_delta of their own block."""
    from jaxserve.entrypoints.openai.protocol import ChatMessage, DeltaFunctionCall, DeltaToolCall
    from jaxserve.entrypoints.openai.serving_messages import _Blocks

    def call(i, name, args):
        return DeltaToolCall(i, "x", "function", DeltaFunctionCall(name, args))

    blocks = _Blocks()
    raw = [
        *blocks.delta(ChatMessage(reasoning="think")),
        *blocks.delta(ChatMessage(reasoning="ing")),
        *blocks.delta(ChatMessage(content="Hi")),
        *blocks.delta(ChatMessage(tool_calls=[call(0, "f", '{"a"')])),
        *blocks.delta(ChatMessage(tool_calls=[call(0, None, ": 1}")])),
        *blocks.delta(ChatMessage(tool_calls=[call(1, "g", "{}")])),
        *blocks.delta(None),
        *blocks.stop(),
    ]
    events = []
    for chunk in raw:
        name, data = chunk.decode().strip().split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    summary = [
        (data["index"], data.get("content_block", data.get("delta", {})).get("type"))
        for _, data in events
    ]
    assert summary == [
        (0, "thinking"), (0, "thinking_delta"), (0, "thinking_delta"), (0, None),
        (1, "text"), (1, "text_delta"), (1, None),
        (2, "tool_use"), (2, "input_json_delta"), (2, "input_json_delta"), (2, None),
        (3, "tool_use"), (3, "input_json_delta"), (3, None),
    ]  # fmt: skip
    assert events[7][1]["content_block"]["name"] == "f"
    assert events[7][1]["content_block"]["id"].startswith("toolu_")
    assert (
        events[8][1]["delta"]["partial_json"] + events[9][1]["delta"]["partial_json"] == '{"a": 1}'
    )
    assert blocks.tool_use and blocks.stop() == []


# ---------------------------------------------------------------------- in process
def stand_in(tokenizer, output: str = " Paris.", cached: int = 0, **app_kw):  # noqa: F811
    """(app, core): the app over a stand-in core answering `output` (its tokens) to every
    request, each having found `cached` prompt tokens in the prefix cache."""
    core = LogprobCore(cached=cached)
    core.output = tokenizer(output, add_special_tokens=False).input_ids
    engine = AsyncLLM(make_config(tokenizer), core, tokenizer=tokenizer)
    return build_app(engine, ["m"], log_stats_interval=None, **app_kw), core


def with_anthropic(app, *calls):
    """Each call(client) in order, with the official async client over the app; their
    results."""

    httpx2 = import_or_skip("httpx2")  # the HTTP package this anthropic client is built on

    async def main():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://t") as http:
            client = anthropic.AsyncAnthropic(base_url="http://t", api_key="k", http_client=http,
                                              max_retries=0)  # fmt: skip
            return [await call(client) for call in calls]

    try:
        return asyncio.run(main())
    finally:
        if app.state.serving.engine.output_handler is not None:
            app.state.serving.engine.output_handler.cancel()
        app.state.cpu.shutdown(wait=False)


def ask(client, **kwargs):
    return client.messages.create(model="m", max_tokens=5, messages=QUESTION, **kwargs)


async def streamed_usage(client, **kwargs):
    """(message_start's usage, message_delta's usage) of a streamed message."""
    events = [e async for e in await ask(client, stream=True, **kwargs)]
    (start,) = [e.message.usage for e in events if e.type == "message_start"]
    (final,) = [e.usage for e in events if e.type == "message_delta"]
    return start, final


def test_usage_splits_the_prompt_by_the_prefix_cache_with_prompt_tokens_details(tokenizer):  # noqa: F811
    """vLLM's test_anthropic_streaming_cache_usage: with --enable-prompt-tokens-details the
    prompt is input_tokens + cache_read_input_tokens (the engine's prefix-cache hit) +
    cache_creation_input_tokens (its full 16-token blocks less those read), whole and in the
    stream's message_delta; message_start has the whole prompt. Without it: no cache fields."""
    results = {}
    for cached in (0, 16):
        app, core = stand_in(tokenizer, cached=cached, enable_prompt_tokens_details=True)
        results[cached] = with_anthropic(app, ask, streamed_usage)
    prompt = len(core.requests[0].prompt_token_ids)
    full = prompt // 16 * 16
    for cached, (whole, (start, final)) in results.items():
        for usage in (whole.usage, final):
            assert usage.cache_read_input_tokens == cached
            assert usage.cache_creation_input_tokens == full - cached
            assert usage.input_tokens == prompt - full and usage.output_tokens == 2
        assert start.input_tokens == prompt and start.cache_read_input_tokens is None

    app, _ = stand_in(tokenizer, cached=16)
    whole, (start, final) = with_anthropic(app, ask, streamed_usage)
    for usage in (whole.usage, final):
        assert usage.input_tokens == prompt and usage.cache_read_input_tokens is None
        assert usage.cache_creation_input_tokens is None


def test_output_config_and_vllms_fields(tokenizer):  # noqa: F811
    """output_config.format's schema reaches the engine as a JSON constraint (a bad format
    is a 400 naming it); tools [] is no tools; an empty answer is one empty text block;
    count_tokens carries vLLM's context_management; kv_transfer_params go to the engine
    and come back."""
    app, core = stand_in(tokenizer, output="")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"format": {"type": "json_schema", "schema": schema}, "effort": "high"}

    async def bad_format(client):
        with pytest.raises(anthropic.BadRequestError) as e:
            await ask(client, output_config={"format": {"type": "xml", "schema": schema}})
        return e.value

    async def counted(client):
        return await client.messages.count_tokens(model="m", messages=QUESTION)

    kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    structured, empty, bad, count, handed = with_anthropic(
        app, lambda c: ask(c, output_config=fmt), lambda c: ask(c, tools=[]), bad_format, counted,
        lambda c: ask(c, extra_body={"kv_transfer_params": kv}),
    )  # fmt: skip
    assert core.requests[0].sampling_params.structured_outputs.json == schema
    assert structured.content == empty.content == [anthropic.types.TextBlock(type="text", text="")]
    assert core.requests[1].sampling_params.structured_outputs is None
    assert bad.status_code == 400 and "$.output_config.format.type" in str(bad)
    assert count.input_tokens == len(core.requests[0].prompt_token_ids)
    assert count.model_extra["context_management"] == {"original_input_tokens": count.input_tokens}
    assert core.requests[-1].kv_transfer_params == kv
    assert handed.model_extra["kv_transfer_params"]["remote_engine_id"] == "fake"
    assert "kv_transfer_params" not in empty.model_extra  # absent when the engine has none


def test_output_config_maps_onto_the_chat_request():
    def request(**fields) -> MessagesRequest:
        return msgspec.convert({"max_tokens": 1, "messages": QUESTION, **fields}, MessagesRequest)

    output_config = {"effort": "xhigh", "format": {"schema": {"type": "object"}}}
    chat = to_chat_request(request(chat_template_kwargs={"x": 1}, output_config=output_config))
    assert chat.chat_template_kwargs == {"reasoning_effort": "xhigh", "x": 1}
    spec = {"name": "json_schema", "schema": {"type": "object"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": spec}
    empty = to_chat_request(request(output_config={"format": {"schema": {}}}))  # vLLM: none
    assert empty.response_format is None and empty.chat_template_kwargs is None
