"""The model-family tool parsers (`deepseek_v3`, `deepseek_v31`, `deepseek_v32`, `kimi_k2`,
`glm45` / `glm47`, `qwen3_coder`, `qwen3_xml`, `minimax_m2`) on outputs in each model's
published format: whole-text extraction (calls whose arguments validate against the tool's
schema, the content before them), and streaming in many splits and token by token (each
special token one delta; and through the detokenizer of a tokenizer with the markers as
special tokens), every delta a valid chunk for the official openai client, the deltas adding
up to the whole-text result."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import openai.types.chat as oai
import pytest
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.entrypoints.openai.chat_utils import ChoiceParser
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, to_sampling_params
from jaxserve.entrypoints.openai.protocol_output import ChatCompletionChunk, ChatStreamChoice
from jaxserve.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from tests.entrypoints.openai.tool_parsers.test_tool_parsers import splits, stream
from tests.helpers import byte_level_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string"},
                    "days": {"type": "integer"},
                    "detailed": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "options": {"type": "object"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": ["string", "null"]}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
REQUEST = msgspec.convert(
    {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}, ChatCompletionRequest
)

DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_END, DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
K_SECTION, K_CALL = "<|tool_calls_section_begin|>", "<|tool_call_begin|>"
K_ARGS = "<|tool_call_argument_begin|>"
K_END, K_SECTION_END = "<|tool_call_end|>", "<|tool_calls_section_end|>"
SPECIAL_TOKENS = [
    *(DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END),
    *(K_SECTION, K_CALL, K_ARGS, K_END, K_SECTION_END, "<|tool_call_section_begin|>"),
    *("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    *("<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"),
]
DSML = "<｜DSML｜"
DSML_CALLS = "<｜DSML｜function_calls>"
CODE = 'def greet(name):\n    print(f"Hi {name} <b>")\n    return {"ok": True}\n'

# name -> (parser, model output, [(name, arguments)], content)
CASES = {
    "deepseek_v3_two_after_text": (
        "deepseek_v3",
        f"Let me check both.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris", "days": 3}}\n```{DS_END}{DS_CALL}function{DS_SEP}get_time\n'
        f'```json\n{{"tz": "Europe/Paris"}}\n```{DS_END}{DS_CALLS_END}',
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "Europe/Paris"})],
        "Let me check both.",
    ),
    "deepseek_v3_unicode": (
        "deepseek_v3",
        f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Zürich \\u2600", "hours": [6, 18]}}\n```{DS_END}{DS_CALLS_END}',
        [("get_weather", {"city": "Zürich ☀", "hours": [6, 18]})],
        None,
    ),
    "deepseek_v31_two": (
        "deepseek_v31",
        f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Tokyo", "detailed": true}}{DS_END}'
        f'{DS_CALL}get_time{DS_SEP}{{"tz": "Asia/Tokyo"}}{DS_END}{DS_CALLS_END}',
        [("get_weather", {"city": "Tokyo", "detailed": True}), ("get_time", {"tz": "Asia/Tokyo"})],
        None,
    ),
    "deepseek_v31_after_text": (
        "deepseek_v31",
        f'I will look it up.\n\n{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Oslo"}}'
        f"{DS_END}{DS_CALLS_END}",
        [("get_weather", {"city": "Oslo"})],
        "I will look it up.\n\n",
    ),
    "kimi_k2_two_after_text": (
        "kimi_k2",
        f"Checking now.{K_SECTION}{K_CALL}functions.get_weather:0{K_ARGS}"
        f'{{"city": "Beijing", "ratio": 0.5}}{K_END}{K_CALL}functions.get_time:1{K_ARGS}'
        f'{{"tz": "Asia/Shanghai"}}{K_END}{K_SECTION_END}',
        [("get_weather", {"city": "Beijing", "ratio": 0.5}), ("get_time", {"tz": "Asia/Shanghai"})],
        "Checking now.",
    ),
    "kimi_k2_singular_section": (
        "kimi_k2",
        f'<|tool_call_section_begin|>{K_CALL} functions.get_time:0 {K_ARGS} {{"tz": "UTC"}} '
        f"{K_END}<|tool_call_section_end|>",
        [("get_time", {"tz": "UTC"})],
        None,
    ),
    "glm45_typed_values": (
        "glm45",
        "I'll check the weather.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>New York</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>10001</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>detailed</arg_key>\n"
        "<arg_value>true</arg_value>\n<arg_key>options</arg_key>\n"
        '<arg_value>{"units": "metric", "alerts": false}</arg_value>\n</tool_call>',
        [
            (
                "get_weather",
                {
                    "city": "New York",
                    "zip": "10001",
                    "days": 2,
                    "detailed": True,
                    "options": {"units": "metric", "alerts": False},
                },
            )
        ],  # fmt: skip
        "I'll check the weather.\n",
    ),
    "glm45_two_calls_python_literal": (
        "glm45",
        "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>  CET  </arg_value>\n"
        "</tool_call>\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"
        "</arg_value><arg_key>hours</arg_key><arg_value>[9, 12]</arg_value><arg_key>options"
        "</arg_key><arg_value>{'units': 'metric'}</arg_value></tool_call>",
        [
            ("get_time", {"tz": "CET"}),
            ("get_weather", {"city": "Rome", "hours": [9, 12], "options": {"units": "metric"}}),
        ],
        None,
    ),  # fmt: skip
    "qwen3_coder_typed": (
        "qwen3_coder",
        "Sure, let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan "
        "Francisco\n</parameter>\n<parameter=zip>\n94103\n</parameter>\n<parameter=days>\n5\n"
        "</parameter>\n<parameter=ratio>\n2.0\n</parameter>\n<parameter=detailed>\nFalse\n"
        "</parameter>\n<parameter=hours>\n[8, 20]\n</parameter>\n</function>\n</tool_call>",
        [
            (
                "get_weather",
                {
                    "city": "San Francisco",
                    "zip": "94103",
                    "days": 5,
                    "ratio": 2,
                    "detailed": False,
                    "hours": [8, 20],
                },
            )
        ],  # fmt: skip
        "Sure, let me check.\n",
    ),
    "qwen3_coder_code_and_second_call": (
        "qwen3_coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/greet.py\n</parameter>\n"
        f"<parameter=content>\n{CODE}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=tz>\nnull\n</parameter>\n</function>\n</tool_call>",
        [("write_file", {"path": "src/greet.py", "content": CODE}), ("get_time", {"tz": None})],
        None,
    ),
    "qwen3_xml_typed": (
        "qwen3_xml",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n"
        '<parameter=options>\n{"units": "metric"}\n</parameter>\n<parameter=days>\n7\n'
        "</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"city": "Lyon", "options": {"units": "metric"}, "days": 7})],
        None,
    ),
    "minimax_m2_typed_after_thinking": (
        "minimax_m2",
        "<think>Weather, then time.</think>\nChecking.\n<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="city">São Paulo</parameter>\n'
        '<parameter name="days">3</parameter>\n<parameter name="detailed">true</parameter>\n'
        '<parameter name="hours">[7, 19]</parameter>\n</invoke>\n<invoke name="get_time">\n'
        '<parameter name="tz">null</parameter>\n</invoke>\n</minimax:tool_call>',
        [
            ("get_weather", {"city": "São Paulo", "days": 3, "detailed": True, "hours": [7, 19]}),
            ("get_time", {"tz": None}),
        ],
        "<think>Weather, then time.</think>\nChecking.\n",
    ),  # fmt: skip
    "minimax_m2_code": (
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="write_file">\n<parameter name="path">a.py'
        f'</parameter>\n<parameter name="content">\n{CODE}\n</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
        [("write_file", {"path": "a.py", "content": CODE})],
        None,
    ),
    "glm47_name_then_args_and_no_args": (
        "glm47",
        "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>get_time"
        "</tool_call>",
        [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})],
        "Checking.",
    ),
    "deepseek_v32_typed_after_content": (
        "deepseek_v32",
        f'Let me check.\n\n{DSML_CALLS}\n{DSML}invoke name="get_weather">\n'
        f'{DSML}parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
        f'{DSML}parameter name="days" string="false">3</｜DSML｜parameter>\n'
        f'{DSML}parameter name="hours" string="false">[7, 19]</｜DSML｜parameter>\n'
        f'{DSML}parameter name="zip" string="true">10001</｜DSML｜parameter>\n'
        f'</｜DSML｜invoke>\n{DSML}invoke name="get_time">\n'
        f'{DSML}parameter name="tz" string="false">null</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        [
            ("get_weather", {"city": "杭州", "days": 3, "hours": [7, 19], "zip": "10001"}),
            ("get_time", {"tz": None}),
        ],
        "Let me check.\n\n",
    ),
    "deepseek_v32_code": (
        "deepseek_v32",
        f'{DSML_CALLS}\n{DSML}invoke name="write_file">\n{DSML}parameter name="path" '
        f'string="true">a.py</｜DSML｜parameter>\n{DSML}parameter name="content" '
        f'string="true">\n{CODE}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
        [("write_file", {"path": "a.py", "content": "\n" + CODE})],
        None,
    ),
    "qwen3_xml_no_wrapper_no_params": (
        "qwen3_xml",
        "<function=get_time>\n</function>",
        [("get_time", {})],
        None,
    ),
}

# parser -> outputs that are plain content
PLAIN = {
    "deepseek_v3": ["The weather is nice.", "A <｜tool partial marker is text"],
    "deepseek_v31": ["No tools needed: 2 + 2 = 4."],
    "kimi_k2": ["Sure! <|tool_calls is not a marker."],
    "glm45": ["Use <tool> tags like <b>.", "I would call a tool here."],
    "qwen3_coder": ["<function is not a call", "Here is code: if a < b: pass"],
    "qwen3_xml": ["Plain answer."],
    "minimax_m2": ["<invoke is not a call", 'Say <parameter name="x"> in prose.'],
    "deepseek_v32": ['Set string="true" in <｜DSML｜parameter> tags.', "Plain."],
}
# parser -> outputs cut off or broken: content, no calls
MALFORMED = {
    "deepseek_v3": [f'{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Pa'],
    "deepseek_v31": [
        f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}',  # no end token
        f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}[1, 2]{DS_END}",
    ],
    "kimi_k2": [
        f'{K_SECTION}{K_CALL}functions.get_weather:0{K_ARGS}{{"city": "Par',
        f'{K_SECTION}{K_CALL}get weather{K_ARGS}{{"city": "Paris"}}{K_END}',
    ],
    "glm45": [
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
        "<tool_call>get_weather\nstray text<arg_key>city</arg_key></tool_call>",
    ],
}


def make(name: str) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)(None)


def token_pieces(text: str) -> list[str]:
    """Deltas as a tokenizer with the families' special tokens would give them: each special
    token whole, other text in words and punctuation."""
    special = "|".join(map(re.escape, sorted(SPECIAL_TOKENS, key=len, reverse=True)))
    return [p for p in re.findall(rf"{special}| ?\w+|\s+|[^\w\s]", text) if p]


def check_chunk(delta) -> None:
    """A delta as the official openai client reads a chunk."""
    chunk = ChatCompletionChunk("chatcmpl-1", 0, "m", [ChatStreamChoice(0, delta)])
    parsed = oai.ChatCompletionChunk.model_validate_json(msgspec.json.encode(chunk))
    for call in parsed.choices[0].delta.tool_calls or []:
        assert isinstance(call, ChoiceDeltaToolCall)


@pytest.mark.parametrize("case", CASES)
def test_extract_whole_output(case):
    name, text, expected, content = CASES[case]
    info = make(name).extract_tool_calls(text, REQUEST)
    assert info.tools_called and info.content == content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    assert got == expected
    for call_name, args in got:
        jsonschema.validate(args, SCHEMAS[call_name])
    message = {"role": "assistant", "content": info.content,
               "tool_calls": msgspec.to_builtins(info.tool_calls)}  # fmt: skip
    parsed = oai.ChatCompletionMessage.model_validate(message)
    assert [c.function.name for c in parsed.tool_calls] == [n for n, _ in expected]


@pytest.mark.parametrize("case", CASES)
def test_streaming_adds_up_to_the_whole_output(case):
    name, text, _, _ = CASES[case]
    info = make(name).extract_tool_calls(text, REQUEST)
    expected = [(c.function.name, c.function.arguments) for c in info.tool_calls]
    for how, pieces in {**splits(text), "special tokens": token_pieces(text)}.items():
        content, calls = stream(make(name), pieces, REQUEST)
        assert [(n, a) for _, n, a in calls] == expected, how
        assert content == info.content, how


@pytest.mark.parametrize("case", CASES)
def test_every_streamed_delta_is_a_valid_openai_chunk(case):
    name, text, expected, content = CASES[case]
    parser, prev, got_content, got_calls = make(name), "", "", {}
    deltas = []
    for piece in token_pieces(text):
        deltas.append(
            parser.extract_tool_calls_streaming(prev, prev + piece, piece, request=REQUEST)
        )
        prev += piece
    deltas.append(parser.flush_streaming(prev, REQUEST))
    for delta in filter(None, deltas):
        check_chunk(delta)
        got_content += delta.content or ""
        for c in delta.tool_calls:
            entry = got_calls.setdefault(c.index, [c.id, "", ""])
            entry[1] += c.function.name or ""
            entry[2] += c.function.arguments or ""
    assert (got_content or None) == content
    assert [(n, json.loads(a)) for _, n, a in got_calls.values()] == expected
    assert all(i for i, _, _ in got_calls.values())


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in PLAIN.items() for t in ts])
def test_plain_text_stays_content(name, text):
    info = make(name).extract_tool_calls(text, REQUEST)
    assert not info.tools_called and info.content == text
    for how, pieces in splits(text).items():
        content, calls = stream(make(name), pieces, REQUEST)
        assert calls == [] and content == text, how


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in MALFORMED.items() for t in ts])
def test_malformed_output_is_content(name, text):
    info = make(name).extract_tool_calls(text, REQUEST)
    assert not info.tools_called and info.content == text
    for pieces in splits(text).values():
        content, calls = stream(make(name), pieces, REQUEST)  # must not raise
        assert text.startswith(content or "")
        if not calls:
            assert content == text


def test_kimi_ids_are_the_models_own():
    text = CASES["kimi_k2_two_after_text"][1]
    ids = ["functions.get_weather:0", "functions.get_time:1"]
    assert [c.id for c in make("kimi_k2").extract_tool_calls(text, REQUEST).tool_calls] == ids
    for pieces in (token_pieces(text), [text]):
        _, calls = stream(make("kimi_k2"), pieces, REQUEST)
        assert [i for i, _, _ in calls] == ids


def streamed_arguments(name: str, text: str, upto: int) -> tuple[str, str]:
    """(the arguments sent once text[:upto] is generated, all of them), a character a delta."""
    parser, prev, early, args = make(name), "", None, ""
    for ch in text:
        d = parser.extract_tool_calls_streaming(prev, prev + ch, ch, request=REQUEST)
        prev += ch
        args += "".join(c.function.arguments or "" for c in d.tool_calls) if d else ""
        if len(prev) == upto:
            early = args
    d = parser.flush_streaming(prev, REQUEST)
    args += "".join(c.function.arguments or "" for c in d.tool_calls) if d else ""
    return early, args


@pytest.mark.parametrize(
    "name,case,upto,sent",
    [
        ("qwen3_coder", "qwen3_coder_code_and_second_call", "return", "def greet(name):\\n"),
        ("glm45", "glm45_typed_values", "York", '{"city": "New'),
        ("deepseek_v31", "deepseek_v31_two", "Tokyo", '{"city": "'),
        ("kimi_k2", "kimi_k2_two_after_text", "Beijing", '{"city": "'),
        ("deepseek_v32", "deepseek_v32_code", "return", "def greet(name):\\n"),
    ],
)
def test_arguments_stream_while_written(name, case, upto, sent):
    """A string value goes out as it is written, before its call (or value) ends."""
    text = CASES[case][1]
    early, args = streamed_arguments(name, text, text.index(upto))
    assert sent in early
    info = make(name).extract_tool_calls(text, REQUEST)
    assert args == "".join(c.function.arguments for c in info.tool_calls)


def test_qwen3_typing_coder_and_xml():
    """qwen3_coder reads a type it does not know as a literal, qwen3_xml as a string; a value
    its type cannot read stays text; a name the schema lacks is a string."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
              "properties": {"a": {"type": "custom"}, "n": {"type": "integer"},
                             "b": {"type": "boolean"}}}}}]  # fmt: skip
    req = msgspec.convert({"messages": [], "tools": tools}, ChatCompletionRequest)
    text = ("<tool_call>\n<function=f>\n<parameter=a>\n[1, 2]\n</parameter>\n<parameter=n>\n"
            "seven\n</parameter>\n<parameter=b>\nTRUE\n</parameter>\n<parameter=x>\n42\n"
            "</parameter>\n</function>\n</tool_call>")  # fmt: skip
    coder = make("qwen3_coder").extract_tool_calls(text, req).tool_calls[0].function.arguments
    xml = make("qwen3_xml").extract_tool_calls(text, req).tool_calls[0].function.arguments
    assert json.loads(coder) == {"a": [1, 2], "n": "seven", "b": True, "x": "42"}
    assert json.loads(xml) == {"a": "[1, 2]", "n": "seven", "b": True, "x": "42"}


def test_qwen3_function_open_at_the_end_is_a_call():
    """As vLLM: a function the text ends in is a call with the values written."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    info = make("qwen3_coder").extract_tool_calls(text, REQUEST)
    assert [json.loads(c.function.arguments) for c in info.tool_calls] == [{"city": "Paris"}]
    content, calls = stream(make("qwen3_coder"), token_pieces(text), REQUEST)
    assert content is None and [(n, json.loads(a)) for _, n, a in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_glm45_without_tools_reads_values_as_literals():
    text = CASES["glm45_typed_values"][1]
    info = make("glm45").extract_tool_calls(text, None)
    assert json.loads(info.tool_calls[0].function.arguments)["zip"] == 10001


class Added:
    def __init__(self, content):
        self.content, self.special = content, True


class FakeTokenizer:
    added_tokens_decoder = {i: Added(t) for i, t in enumerate(SPECIAL_TOKENS)}


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31", "kimi_k2", "glm45"])
def test_adjust_request_keeps_special_tokens(name):
    req = ChatCompletionRequest(messages=[], tools=TOOLS)
    parser = ToolParserManager.get_tool_parser(name)(FakeTokenizer())
    assert parser.adjust_request(req).skip_special_tokens is False
    none = ChatCompletionRequest(messages=[], tools=TOOLS, tool_choice="none")
    assert parser.adjust_request(none).skip_special_tokens is True
    if name != "glm45":  # (vLLM's glm45 keeps them whenever tools may be called)
        req = ChatCompletionRequest(messages=[], tools=TOOLS)
        assert make(name).adjust_request(req).skip_special_tokens is True


def test_registered_names():
    names = {"deepseek_v3", "deepseek_v31", "deepseek_v32", "glm45", "glm47", "kimi_k2",
             "qwen3_coder", "qwen3_xml"}  # fmt: skip
    assert names <= set(ToolParserManager.list_names())


@pytest.fixture(scope="module")
def special_tokenizer():
    """A byte-level tokenizer with the families' call markers as special tokens."""
    return byte_level_tokenizer(SPECIAL_TOKENS, "<eos>")


@pytest.mark.parametrize("case", CASES)
def test_detokenized_token_by_token_in_the_chat_layer(case, special_tokenizer):
    """Through the detokenizer, token by token, as the chat layer streams: adjust_request
    keeps the special markers in the text, and the calls come out as from the whole text."""
    name, text, expected, content = CASES[case]
    tok, cls = special_tokenizer, ToolParserManager.get_tool_parser(name)
    req = cls(tok).adjust_request(msgspec.structs.replace(REQUEST))
    params = to_sampling_params(req, {}, max_tokens=16, logprobs=None)
    assert not params.skip_special_tokens
    detok = IncrementalDetokenizer(tok, tok("hi", add_special_tokens=False).input_ids, params)
    parser, got, got_content = ChoiceParser(req, cls, None, tok), {}, ""
    deltas = []
    for token in tok(text, add_special_tokens=False).input_ids:
        before = detok.output_text
        detok.update([token])
        deltas.append(parser.delta(detok.output_text[len(before) :], [token]))
    for d in filter(None, [*deltas, parser.finish()]):
        got_content += d.content or ""
        for c in d.tool_calls:
            entry = got.setdefault(c.index, ["", ""])
            entry[0] += c.function.name or ""
            entry[1] += c.function.arguments or ""
    assert detok.output_text == text
    assert [(n, json.loads(a)) for n, a in got.values()] == expected
    assert (got_content or None) == content
