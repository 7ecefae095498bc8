"""What vLLM's own API tests expect of tool choice and the tokenization routes: tool_choice
"required" over tools whose parameters use $defs / $ref (pydantic's schemas), a named call cut
off by max_tokens, /tokenize's vLLM fields (return_token_strs, tools, continue_final_message)
and GET /tokenizer_info. Tool choice through the openai client on the package's shared server
(the default model, --tool-call-parser hermes); the tokenization routes in process, over a
stand-in engine core with the bundled model's tokenizer."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.openai.serve_options import ServeOptions
from jaxserve.entrypoints.openai.tool_schema import relocate_refs, required_calls_schema
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.entrypoints.openai.test_http_hardening import message, post, serve
from tests.require import import_or_skip

ASK = [{"role": "user", "content": "Plan a trip from Paris to Rome."}]
CHAT = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Nice to meet you!"},
    {"role": "user", "content": "Can I ask a question?"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}
CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# A template that renders tools (the bundled model's ignores them)
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}"
    "{% endif %}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def pydantic_tools() -> list[dict]:
    """Two tools whose parameters are pydantic's model_json_schema: each refers to a model
    of its own named `Place` through "#/$defs/Place" (same name, different schemas)."""
    pydantic = import_or_skip("pydantic")
    closed = pydantic.ConfigDict(extra="forbid")  # (a 135M model invents keys otherwise)

    class Place(pydantic.BaseModel):
        model_config = closed
        city: str = pydantic.Field(max_length=12)

    class Trip(pydantic.BaseModel):
        model_config = closed
        origin: Place
        destination: Place

    class Zone(pydantic.BaseModel):
        model_config = closed
        zone: int = pydantic.Field(ge=0, le=9)

    Zone.__name__ = "Place"  # the same $defs name as the other tool's Place

    class Stay(pydantic.BaseModel):
        model_config = closed
        where: Zone
        nights: int = pydantic.Field(ge=1, le=9)

    def tool(name: str, model) -> dict:
        return {
            "type": "function",
            "function": {"name": name, "parameters": model.model_json_schema()},
        }

    tools = [tool("plan_trip", Trip), tool("book_stay", Stay)]
    assert all("$defs" in t["function"]["parameters"] for t in tools)  # what this is about
    return tools


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's


# ---------------------------------------------------------------------- tool choice
@pytest.mark.slow
@pytest.mark.parametrize("which", [[0], [0, 1]], ids=["one-tool", "two-tools-same-defs-name"])
def test_required_tool_choice_with_defs_and_refs_gives_valid_calls(client, which):
    """It was a 400 "Pointer '/$defs/Place' does not exist": the tools' $refs were left
    pointing at the array schema's root."""
    jsonschema = import_or_skip("jsonschema")
    tools = [pydantic_tools()[i] for i in which]
    r = client.chat.completions.create(
        model="smol", messages=ASK, tools=tools, tool_choice="required", temperature=0,
        max_tokens=80, parallel_tool_calls=False,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_tool_call_cut_off_by_max_tokens_is_no_call(client, tool_choice):
    """vLLM's test_max_tokens_with_tool_choice_required: arguments cut short are not a call;
    the content is empty and the finish reason says why."""
    r = client.chat.completions.create(
        model="smol", messages=ASK, tools=[CITY_TOOL], tool_choice=tool_choice,
        temperature=0, max_completion_tokens=1,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and choice.message.content == ""


@pytest.mark.slow
def test_a_streamed_named_call_cut_off_ends_with_length(client):
    """Streamed, a named call's arguments go out as they come (as vLLM's do): cut off, what
    came is a prefix of the whole call, and the one finish reason is "length"."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="smol", messages=ASK, tools=[CITY_TOOL], tool_choice=named)
    whole = client.chat.completions.create(**kwargs, max_tokens=40, temperature=0).choices[0]
    arguments, finishes = "", []
    for chunk in client.chat.completions.create(**kwargs, max_tokens=3, temperature=0, stream=True):
        for c in chunk.choices:
            finishes += [c.finish_reason] if c.finish_reason else []
            for d in c.delta.tool_calls or []:
                arguments += d.function.arguments or ""
    assert finishes == ["length"]
    assert whole.message.tool_calls[0].function.arguments.startswith(arguments)
    assert arguments  # something came (3 tokens of JSON)


def test_each_tool_of_required_keeps_its_own_definitions():
    """Two tools define a `Place` of their own: each call's parameters follow its tool's."""
    jsonschema = import_or_skip("jsonschema")
    functions = {t["function"]["name"]: t["function"] for t in pydantic_tools()}
    schema = required_calls_schema(functions, parallel=True)
    stay = {"name": "book_stay", "parameters": {"where": {"zone": 3}, "nights": 2}}
    trip = {"name": "plan_trip", "parameters": {"origin": {"city": "Paris"},
                                                "destination": {"city": "Rome"}}}  # fmt: skip
    jsonschema.validate([stay, trip], schema)
    swapped = {"name": "book_stay", "parameters": {"where": {"city": "Rome"}, "nights": 2}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([swapped], schema)
    one = required_calls_schema({"book_stay": functions["book_stay"]}, parallel=False)
    jsonschema.validate([stay], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([stay, stay], one)  # parallel=False: one call


def test_relocated_refs_point_at_the_same_definitions():
    schema = {
        "$defs": {"A": {"properties": {"next": {"$ref": "#/$defs/A"}}}},
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "self": {"$ref": "#"},
            "default": {"$ref": "#/$defs/A"},  # a property named like a data keyword
            "b": {"default": {"$ref": "#/not/a/schema"}, "const": {"$ref": "#"}},
            "c": {"$ref": "https://example.com/s.json#/x"},
        },
    }
    out = relocate_refs(schema, "/items/properties/parameters")
    at = "#/items/properties/parameters"
    assert out["$defs"]["A"]["properties"]["next"]["$ref"] == at + "/$defs/A"
    assert out["properties"]["a"]["$ref"] == at + "/$defs/A"
    assert out["properties"]["self"]["$ref"] == at
    assert out["properties"]["default"]["$ref"] == at + "/$defs/A"
    assert out["properties"]["b"] == schema["properties"]["b"]  # data, untouched
    assert out["properties"]["c"] == schema["properties"]["c"]  # another document's


# ---------------------------------------------------------------------- /tokenize
def test_tokenize_returns_token_strs_when_asked(tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    asked, plain = serve(tokenizer, [
        post("/tokenize", {"prompt": prompt, "return_token_strs": True}),
        post("/tokenize", {"prompt": prompt}),
    ])  # fmt: skip
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    assert asked.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                            "token_strs": tokenizer.convert_ids_to_tokens(ids)}  # fmt: skip
    assert plain.json()["token_strs"] is None and plain.json()["tokens"] == ids


@pytest.mark.parametrize("with_tools", [False, True])
def test_tokenize_messages_equals_apply_chat_template(tokenizer, with_tools):
    """vLLM's test_tokenize_chat(_with_tools): every add_generation_prompt /
    continue_final_message / add_special_tokens combination, tools rendered as chat
    completions render them, the final assistant turn left open with continue_final_message."""
    tools = [WEATHER_TOOL] if with_tools else None
    cases, bodies = [], []
    for add_generation in (False, True):
        for add_special in (False, True):
            for continue_final in (False, True):
                if add_generation and continue_final:
                    continue
                chat = CHAT + (
                    [{"role": "assistant", "content": "Sure,"}] if continue_final else []
                )
                prompt = tokenizer.apply_chat_template(
                    chat, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False,
                    add_generation_prompt=add_generation, continue_final_message=continue_final,
                )  # fmt: skip
                cases.append(tokenizer.encode(prompt, add_special_tokens=add_special))
                bodies.append(post("/tokenize", {
                    "messages": chat, "tools": tools, "add_special_tokens": add_special,
                    "add_generation_prompt": add_generation,
                    "continue_final_message": continue_final,
                }))  # fmt: skip
    responses = serve(tokenizer, bodies, chat_template=TOOLS_TEMPLATE)
    for expected, r in zip(cases, responses, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    assert tokenizer.decode(cases[1]).endswith("Sure,")  # (the open turn, as checked)


def test_tokenize_refuses_what_cannot_be_rendered(tokenizer):
    both, bad_tool, neither = serve(tokenizer, [
        post("/tokenize", {"messages": CHAT, "continue_final_message": True,
                           "add_generation_prompt": True}),
        post("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {}}]}),
        post("/tokenize", {}),
    ])  # fmt: skip
    assert both.status_code == 400
    assert (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        in message(both)
    )
    assert bad_tool.status_code == 400 and "tools[0].function.name" in message(bad_tool)
    assert neither.status_code == 400 and "prompt or messages" in message(neither)


# ---------------------------------------------------------------------- /tokenizer_info
def test_tokenizer_info_only_with_its_flag(tokenizer):
    (off,) = serve(tokenizer, [{"method": "GET", "url": "/tokenizer_info"}])
    assert off.status_code == 404 and off.json()["error"]["type"] == "NotFoundError"
    options = ServeOptions(enable_tokenizer_info_endpoint=True)
    (on,) = serve(tokenizer, [{"method": "GET", "url": "/tokenizer_info"}], options=options)
    assert on.status_code == 200
    info = on.json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # not a local path
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & info.keys()
    # vLLM's test_tokenizer_info_schema: the types its clients read
    types = {"add_bos_token": bool, "clean_up_tokenization_spaces": bool, "bos_token": str,
             "eos_token": str, "pad_token": str, "unk_token": str, "chat_template": str,
             "model_max_length": int, "additional_special_tokens": list,
             "added_tokens_decoder": dict}  # fmt: skip
    for field, kind in types.items():
        assert info.get(field) is None or isinstance(info[field], kind), field


def test_tokenizer_info_chat_template_is_the_servers(tokenizer):
    options = ServeOptions(enable_tokenizer_info_endpoint=True)
    (r,) = serve(tokenizer, [{"method": "GET", "url": "/tokenizer_info"}], options=options,
                 chat_template=TOOLS_TEMPLATE)  # fmt: skip
    assert r.json()["chat_template"] == TOOLS_TEMPLATE
