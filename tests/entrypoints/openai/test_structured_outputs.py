"""Structured outputs and tool calling through the official openai client, on the default
model (the package's shared server: --enable-auto-tool-choice --tool-call-parser hermes)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.require import import_or_skip

# Absent on the GPU machine: skip, collect cleanly (CI fails instead: tests/require.py).
openai = import_or_skip("openai")
jsonschema = import_or_skip("jsonschema")

from tests.entrypoints.openai.test_api_server import MODEL  # noqa: E402
from tests.entrypoints.test_llm import PERSON  # noqa: E402

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_json_schema_always_validates_over_8_concurrent_sampled_requests(client):
    def one(i):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=1.0, max_tokens=200, seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )  # fmt: skip
        return r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 4


def test_regex_choice_json_object_and_legacy_fields_match(client):
    # every request at once (one batch, not ten in turn): each is checked on its own
    def regex(i):
        return client.completions.create(
            model=MODEL, prompt="My phone number is", temperature=1.0, max_tokens=30, seed=i,
            extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}},
        ).choices[0].text  # fmt: skip

    def choice(i):
        return client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=1.0, max_tokens=10, seed=i,
            extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
        ).choices[0].message.content  # fmt: skip

    def legacy():
        return client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=10,
            extra_body={"guided_choice": ["alpha", "beta"]},
        ).choices[0].message.content  # fmt: skip

    def obj():
        return client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=120, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": 'Reply with {"answer": 2 + 2} as JSON.'}],
        ).choices[0].message.content  # fmt: skip

    with ThreadPoolExecutor(10) as pool:
        regexes = [pool.submit(regex, i) for i in range(4)]
        choices = [pool.submit(choice, i) for i in range(4)]
        legacy_text, obj_text = pool.submit(legacy), pool.submit(obj)
        for text in regexes:
            assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text.result())
        for text in choices:
            assert text.result() in ("positive", "negative")
        assert legacy_text.result() in ("alpha", "beta")
        assert isinstance(json.loads(obj_text.result()), dict)


def test_named_and_required_tool_calls_always_have_valid_arguments(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

    def named(i):
        return client.chat.completions.create(
            model=MODEL, messages=TOOL_ASK, tools=[WEATHER, TIME], temperature=1.0, seed=i,
            max_tokens=100, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ).choices[0]  # fmt: skip

    def required(i):
        return client.chat.completions.create(
            model=MODEL, messages=TOOL_ASK, tools=[WEATHER, TIME], temperature=1.0, seed=i,
            max_tokens=150, tool_choice="required", parallel_tool_calls=False,
        ).choices[0]  # fmt: skip

    with ThreadPoolExecutor(4) as pool:  # all four at once (one batch), each checked alone
        named_futures = [pool.submit(named, i) for i in range(2)]
        required_futures = [pool.submit(required, i) for i in range(2)]
        named_choices = [f.result() for f in named_futures]
        required_choices = [f.result() for f in required_futures]
    for choice in named_choices:
        assert choice.finish_reason == "stop" and choice.message.content == ""
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and re.fullmatch(
            r"chatcmpl-tool-[0-9a-f]{32}", call.id
        )
        jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    for choice in required_choices:  # (one call: a 135M model may repeat calls endlessly)
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_call_deltas_concatenate_to_the_non_streamed_call(client, tool_choice):
    kwargs = dict(model=MODEL, messages=TOOL_ASK, tools=[WEATHER, TIME], temperature=0,
                  max_tokens=150, tool_choice=tool_choice)  # fmt: skip
    with ThreadPoolExecutor(1) as pool:  # the whole answer beside the stream (one batch)
        whole_future = pool.submit(lambda: client.chat.completions.create(**kwargs).choices[0])
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    if d.id:
                        assert call["id"] is None and d.function.name  # id and name come first
                        call["id"], call["name"] = d.id, d.function.name
                    call["arguments"] += d.function.arguments or ""
        whole = whole_future.result()
    expected = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert finish == whole.finish_reason


def test_auto_tool_choice_and_tool_history_render(client):
    """tool_choice auto (the hermes parser reads the text), with a history of an assistant
    call and its tool result going through the chat template."""
    history = [
        *TOOL_ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=30
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "needs a json_schema object with a schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "Invalid regex specification"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "only one output constraint"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": []}, "tools must not be empty"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "'nope', which is not in tools"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "cannot be combined"),
    ],
)  # fmt: skip
def test_bad_constraints_and_tool_settings_are_400s(client, body, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=body)
    assert message in e.value.message
