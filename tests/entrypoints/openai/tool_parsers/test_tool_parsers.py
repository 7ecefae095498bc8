"""Tool-call parsers on recorded model outputs: whole-text extraction, and streaming in many
splits, whose deltas must add up to exactly the whole-text result."""

from __future__ import annotations

import json
import random
import re

import pytest

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, DeltaToolCall
from jaxserve.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from jaxserve.entrypoints.openai.tool_parsers.utils import ScanMemo, json_prefix

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
REQUEST = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])

# --------------------------------------------------------------- recorded outputs
# name -> (parser, model output, expected calls [(name, arguments dict)], expected content)
CASES = {
    "hermes_one": (
        "hermes",
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", '
        '"state": "TX", "unit": "fahrenheit"}}\n</tool_call>',
        [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})],
        None,
    ),
    "hermes_two_qwen": (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
        None,
    ),
    "hermes_after_text": (
        "hermes",
        "I'll check the weather in Paris for you.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [("get_weather", {"city": "Paris"})],
        "I'll check the weather in Paris for you.\n\n",
    ),
    "hermes_whitespace_before": (
        "hermes",
        '\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        [("get_weather", {"city": "Oslo"})],
        None,
    ),
    "hermes_compact_nested_numbers": (
        "hermes",
        '<tool_call>{"name":"create_event","arguments":{"title":"Standup","attendees":'
        '[{"name":"Ann","email":"ann@x.org"},{"name":"Bob"}],"options":{"remind":true,'
        '"minutes":[5,10.50,1e3,-0],"notes":null,"empty":{},"none":[]}}}</tool_call>',
        [
            (
                "create_event",
                {
                    "title": "Standup",
                    "attendees": [{"name": "Ann", "email": "ann@x.org"}, {"name": "Bob"}],
                    "options": {
                        "remind": True,
                        "minutes": [5, 10.5, 1000.0, 0],
                        "notes": None,
                        "empty": {},
                        "none": [],
                    },
                },
            )
        ],
        None,
    ),
    "hermes_unicode_and_escapes": (
        "hermes",
        '<tool_call>\n{"name": "translate", "arguments": {"text": "Grüß Gott — 你好 😀, '
        'caf\\u00e9 \\ud83d\\ude00 \\"q\\" a\\\\b\\nnew line\\ttab \\/"}}\n</tool_call>',
        [("translate", {"text": 'Grüß Gott — 你好 😀, café 😀 "q" a\\b\nnew line\ttab /'})],
        None,
    ),
    "hermes_unclosed_last_block": (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        [("get_weather", {"city": "Rome"})],
        None,
    ),
    "hermes_arguments_as_string": (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
        [("get_weather", {"city": "Rome"})],
        None,
    ),
    "llama_one": (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
        None,
    ),
    "llama_python_tag_two": (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        None,
    ),
    "llama_arguments_key_nested_unicode": (
        "llama3_json",
        '\n{"name": "search", "arguments": {"query": "Zürich café ☕", "filters": '
        '{"year": [2023, 2024], "exact": false}}}',
        [
            (
                "search",
                {"query": "Zürich café ☕", "filters": {"year": [2023, 2024], "exact": False}},
            )
        ],
        None,
    ),
    "mistral_array": (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}]',
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
        None,
    ),
    "mistral_array_two_after_text": (
        "mistral",
        'Let me look that up.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}},'
        ' {"name": "get_time", "arguments": {"tz": "CET"}}]</s>',
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
        "Let me look that up.",
    ),
    "mistral_args_token_form": (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"tz": "CET"})],
        None,
    ),
    "mistral_name_json_form": (
        "mistral",
        '[TOOL_CALLS]get_weather{"city": "Kraków"}',
        [("get_weather", {"city": "Kraków"})],
        None,
    ),
    "pythonic_two": (
        "pythonic",
        '[get_weather(city="Paris", unit=\'celsius\'), get_time(tz="CET")]',
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET"})],
        None,
    ),
    "pythonic_literals": (
        "pythonic",
        '[book(flight={"from": "SFO", "to": "CDG"}, seats=[1, 2], pair=(3, "x"), '
        "refundable=True, note=None, price=-12.5, name='日本語 ✓ \\'q\\'')]",
        [
            (
                "book",
                {
                    "flight": {"from": "SFO", "to": "CDG"},
                    "seats": [1, 2],
                    "pair": [3, "x"],
                    "refundable": True,
                    "note": None,
                    "price": -12.5,
                    "name": "日本語 ✓ 'q'",
                },
            )
        ],
        None,
    ),
    "pythonic_brackets_in_strings": (
        "pythonic",
        '[note(text="a ) ] , \\" \' ( {", more=\'x"y\', doc="""tri " ) ple""")]',
        [("note", {"text": "a ) ] , \" ' ( {", "more": 'x"y', "doc": 'tri " ) ple'})],
        None,
    ),
    "pythonic_empty_and_triple_quotes": (
        "pythonic",
        "[f(a='', b='''x''y''', c=\"\", d=\"\"\"a\"b\"\"\")]",
        [("f", {"a": "", "b": "x''y", "c": "", "d": 'a"b'})],
        None,
    ),
    "pythonic_no_args_multiline": (
        "pythonic",
        '\n[\n  get_time(),\n  get_weather(\n    city="Paris",\n  ),\n]\n',
        [("get_time", {}), ("get_weather", {"city": "Paris"})],
        None,
    ),
    "pythonic_llama4_tags": (
        "llama4_pythonic",
        '<|python_start|>[get_weather(city="Paris")]<|python_end|>',
        [("get_weather", {"city": "Paris"})],
        None,
    ),
}

# parser -> outputs that are plain content, not calls
PLAIN = {
    "hermes": [
        "The weather in Paris is sunny, 22 °C.",
        "Use a <tool> tag, or <tool_c if you like.",
        "  \n",
        "",
    ],
    "llama3_json": [
        "Paris is the capital of France.",
        '{"answer": 42}',
        '{"name": "Bob", "age": 3}',
        "<|python_tag|>import math; print(math.pi)",
        "  <|pyth",
    ],
    "mistral": ["Bonjour ! [1] est une référence.", "[TOOL_CALL", "[TOOL_CALLS] []"],
    "pythonic": [
        "[1] See the docs.",
        "Here you go: [a link](https://example.com)",
        "[get_weather(city=some_variable)]",
        "[get_weather('Paris')]",
        '[print(open("x").read())]',
        "[a.b(x=1)]",
        "[]",
        "Sure!",
        "<|python_start|>hello",
    ],
}

# parser -> cut-off or broken outputs (some turn bad only after a call was streamed):
# whole-text extraction gives them back as content
MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "<tool_call>\n{\"name\": get_weather, 'arguments': {}}\n</tool_call>",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "argu',
        '<tool_call>{"arguments": [1, 2], "name": "x"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"s": "bad \x01 control"}}</tool_call>',
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Pa',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} {"name": "x"',
        '{"name": "f", "parameters": {"n": 01}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some prose',
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par',
        '[TOOL_CALLS]get_weather[ARGS]{"city": ',
        "[TOOL_CALLS] [1, 2]",
    ],
    "pythonic": [
        '[get_weather(city="Par',
        '[get_weather(city="Paris"), get_time(tz=',
        "[get_weather(city=\"Paris\"), get_time(tz='CET'))]",
        '[get_weather(city="Paris")',
        '[get_weather(city="Paris")] is what I would call.',
    ],
}


# --------------------------------------------------------------- streaming helpers
def token_like(text: str) -> list[str]:
    """Pieces like a BPE tokenizer's: words with their leading space, runs of punctuation."""
    return re.findall(r" ?\w+|\s+|[^\w\s]{1,3}", text)


def splits(text: str) -> dict[str, list[str]]:
    rng = random.Random(len(text))
    random_cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    bounds = [0, *random_cuts, len(text)]
    out = {
        "chars": list(text),
        "chunks3": [text[i : i + 3] for i in range(0, len(text), 3)],
        "chunks7": [text[i : i + 7] for i in range(0, len(text), 7)],
        "tokens": token_like(text),
        "random": [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)],
        "whole": [text],
    }
    for name, pieces in out.items():
        assert "".join(pieces) == text, name
    return out


def stream(parser: ToolParser, pieces: list[str], request=None):
    """Feed `pieces` as deltas, then flush. Returns (content or None, [(id, name, arguments)])
    and checks the shape of every delta on the way."""
    content, calls, prev = "", [], ""
    deltas = []
    for piece in pieces:
        cur = prev + piece
        deltas.append(
            (False, parser.extract_tool_calls_streaming(prev, cur, piece, [], [], [], request))
        )
        prev = cur
    deltas.append((True, parser.flush_streaming(prev, request)))
    for final, delta in deltas:
        if delta is None:
            continue
        assert delta.content is not None or delta.tool_calls, "empty deltas are sent as None"
        content += delta.content or ""
        seen = set()
        for tc in delta.tool_calls:
            assert isinstance(tc, DeltaToolCall)
            assert tc.index not in seen, "one entry per call per delta"
            seen.add(tc.index)
            if tc.index == len(calls):  # a call's first delta: id, type, name
                assert tc.id and tc.type == "function" and tc.function.name
                if not final:
                    assert tc.function.arguments is None
                calls.append([tc.id, tc.function.name, tc.function.arguments or ""])
            else:
                assert tc.index < len(calls), "calls are opened in order"
                assert tc.id is None and tc.type is None and tc.function.name is None
                assert tc.function.arguments
                calls[tc.index][2] += tc.function.arguments
    return content or None, [tuple(c) for c in calls]


def make(name: str) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)(None)


def whole(name: str, text: str):
    info = make(name).extract_tool_calls(text, REQUEST)
    return info, [(tc.function.name, tc.function.arguments) for tc in info.tool_calls]


def assert_stream_matches(name: str, text: str) -> None:
    info, expected = whole(name, text)
    for how, pieces in splits(text).items():
        parser = make(name)
        content, calls = stream(parser, pieces, REQUEST)
        assert [(n, a) for _, n, a in calls] == expected, how
        assert content == (info.content or None), how
        assert parser.streamed_args_for_tool == [a for _, a in expected]


# --------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES)
def test_extract_recorded_output(case):
    name, text, expected, content = CASES[case]
    info, calls = whole(name, text)
    assert info.tools_called
    assert [(n, json.loads(a)) for n, a in calls] == expected
    for (_, a), (_, args) in zip(calls, expected, strict=True):
        assert a == json.dumps(args, ensure_ascii=False)  # the one formatting
    assert info.content == content
    assert all(tc.type == "function" and tc.id for tc in info.tool_calls)


@pytest.mark.parametrize("case", CASES)
def test_streaming_equals_whole_text(case):
    name, text, expected, _ = CASES[case]
    assert_stream_matches(name, text)


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in PLAIN.items() for t in ts])
def test_plain_text_stays_content(name, text):
    info, calls = whole(name, text)
    assert not info.tools_called and calls == [] and info.content == text
    for how, pieces in splits(text).items() if text else [("empty", [""])]:
        content, calls = stream(make(name), pieces)
        assert calls == [] and (content or "") == text, how


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in MALFORMED.items() for t in ts])
def test_malformed_output_is_content_and_streams_safely(name, text):
    info, calls = whole(name, text)
    assert not info.tools_called and calls == [] and info.content == text
    for pieces in splits(text).values():
        content, calls = stream(make(name), pieces)  # must not raise
        assert text.startswith(content or "")
        if not calls:  # nothing committed to a call: the text comes out as content
            assert content == text


@pytest.mark.parametrize(
    "name,text",
    [
        ("hermes", PLAIN["hermes"][0]),
        ("llama3_json", PLAIN["llama3_json"][0]),
        ("mistral", PLAIN["mistral"][0]),
        ("pythonic", PLAIN["pythonic"][0]),
        ("pythonic", PLAIN["pythonic"][1]),
        ("pythonic", PLAIN["pythonic"][4]),
    ],
)
def test_plain_content_is_not_held_back(name, text):
    """Content goes out as it comes once it cannot be a call, not at the end of the stream."""
    parser, prev, content = make(name), "", ""
    for ch in text:
        delta = parser.extract_tool_calls_streaming(prev, prev + ch, ch, [], [], [], None)
        prev += ch
        content += delta.content if delta and delta.content else ""
    assert len(content) >= len(text) - len("[TOOL_CALLS]")


def test_arguments_stream_incrementally():
    """Arguments go out as they are generated, not only when the call ends."""
    text = CASES["hermes_one"][1]
    parser = make("hermes")
    fragments, prev = [], ""
    for ch in text:
        delta = parser.extract_tool_calls_streaming(prev, prev + ch, ch, [], [], [], None)
        prev += ch
        if delta and delta.tool_calls and delta.tool_calls[0].function.arguments:
            fragments.append((len(prev), delta.tool_calls[0].function.arguments))
    assert len(fragments) > 10
    assert fragments[0][0] < text.index("fahrenheit")  # well before the object closes
    assert "".join(f for _, f in fragments) == whole("hermes", text)[1][0][1]
    assert parser.flush_streaming(text) is None  # nothing left
    assert parser.prev_tool_call_arr == [
        {
            "name": "get_current_weather",
            "arguments": {"city": "Dallas", "state": "TX", "unit": "fahrenheit"},
        }
    ]
    assert parser.current_tool_id == 0 and parser.current_tool_name_sent


def test_content_never_shows_partial_markers():
    for name, marker, text in [
        ("hermes", "<tool_call>", CASES["hermes_after_text"][1]),
        ("mistral", "[TOOL_CALLS]", CASES["mistral_array_two_after_text"][1]),
    ]:
        parser, prev = make(name), ""
        for ch in text:
            delta = parser.extract_tool_calls_streaming(prev, prev + ch, ch, [], [], [], None)
            prev += ch
            if delta and delta.content:  # no piece of the marker, even for a moment
                assert marker[0] not in delta.content


def test_mistral_ids_and_adjust_request():
    id_re = re.compile(r"[A-Za-z0-9]{9}")
    info, _ = whole("mistral", CASES["mistral_array_two_after_text"][1])
    assert all(id_re.fullmatch(tc.id) for tc in info.tool_calls)
    _, calls = stream(make("mistral"), token_like(CASES["mistral_args_token_form"][1]))
    assert len(calls) == 2 and all(id_re.fullmatch(i) for i, _, _ in calls)
    parser = make("mistral")
    req = ChatCompletionRequest(messages=[], tools=[WEATHER_TOOL])
    assert parser.adjust_request(req).skip_special_tokens is False
    req = ChatCompletionRequest(messages=[], tools=[WEATHER_TOOL], tool_choice="none")
    assert parser.adjust_request(req).skip_special_tokens is True
    assert parser.adjust_request(ChatCompletionRequest(messages=[])).skip_special_tokens is True


def test_other_ids_are_vllm_style():
    info, _ = whole("hermes", CASES["hermes_two_qwen"][1])
    ids = [tc.id for tc in info.tool_calls]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == 2


class FakeTokenizer:
    class Added:
        def __init__(self, content, special):
            self.content, self.special = content, special

    def __init__(self, special: bool):
        self.added_tokens_decoder = {151657: self.Added("<tool_call>", special)}

    def get_vocab(self):
        return {"<tool_call>": 151657, "</tool_call>": 151658}


def test_tokenizer_is_optional_and_used_when_given():
    req = ChatCompletionRequest(messages=[], tools=[WEATHER_TOOL])
    assert make("hermes").adjust_request(req).skip_special_tokens is True  # no tokenizer
    parser = ToolParserManager.get_tool_parser("hermes")(FakeTokenizer(special=False))
    assert parser.adjust_request(req).skip_special_tokens is True  # Qwen: not special
    assert parser.special_token_id("<tool_call>") == 151657
    assert parser.special_token_id("<nope>") is None
    parser = ToolParserManager.get_tool_parser("hermes")(FakeTokenizer(special=True))
    assert parser.adjust_request(req).skip_special_tokens is False
    assert make("hermes").special_token_id("<tool_call>") is None


def test_registry():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(ToolParserManager.list_names())
    with pytest.raises(KeyError, match="nope.*hermes.*llama3_json.*mistral.*pythonic"):
        ToolParserManager.get_tool_parser("nope")
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        ToolParserManager.get_tool_parser("nope")
    saved = dict(ToolParserManager.tool_parsers)
    try:

        @ToolParserManager.register_module(["my_a", "my_b"])
        class Mine(ToolParser):
            pass

        ToolParserManager.register_module("my_c", module=Mine)
        assert all(ToolParserManager.get_tool_parser(n) is Mine for n in ("my_a", "my_b", "my_c"))
        with pytest.raises(KeyError):
            ToolParserManager.register_module("my_a", force=False, module=Mine)
        with pytest.raises(TypeError):
            ToolParserManager.register_module("my_d", module=int)
    finally:
        ToolParserManager.tool_parsers.clear()
        ToolParserManager.tool_parsers.update(saved)


def test_base_parser_defaults():
    parser = ToolParser(None)
    assert (parser.prev_tool_call_arr, parser.current_tool_id) == ([], -1)
    assert (parser.current_tool_name_sent, parser.streamed_args_for_tool) == (False, [])
    req = ChatCompletionRequest(messages=[], tools=[WEATHER_TOOL])
    assert parser.adjust_request(req) is req
    with pytest.raises(NotImplementedError):
        parser.extract_tool_calls("x", None)
    assert parser.extract_tool_calls_streaming("", "x", "x", [], [], [], None) is None


@pytest.mark.parametrize(
    "doc",
    [
        '{"a": 1, "b": [1, 2.50, -3e2, true, false, null], "c": {"d": "e\\u00e9\\ud83d\\ude00"}}',
        '{"s":"quote \\" back \\\\ nl \\n tab \\t slash \\/ ctl \\u0001","n":{"m":[[],{},[{}]]}}',
        '[ 1 , "x" , { "k" : [ -0.0 , 12345678901234567890 ] } ]',
        '{"emoji": "😀 ünï ✓", "big": 1E+2, "neg": -1, "u": "\\u2028\\ud800x"}',
    ],
)
def test_json_prefix_only_emits_certain_text(doc):
    final = json.dumps(json.loads(doc), ensure_ascii=False)
    seen, memo = "", ScanMemo()
    for i in range(len(doc) + 1):
        out, end = json_prefix(doc[:i], 0)
        assert final.startswith(out), (doc[:i], out)
        assert len(out) >= len(seen)  # never takes anything back
        assert json_prefix(doc[:i], 0, memo.sync(doc[:i])) == (out, end)  # resumed: the same
        seen = out
    assert (seen, end) == (final, len(doc))
    with pytest.raises(ValueError):
        json_prefix('{"a": 1 "b"', 0)
