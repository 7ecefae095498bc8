"""gpt-oss's harmony output: `--reasoning-parser openai_gptoss` (the analysis channel as
reasoning) and `--tool-call-parser openai` (commentary messages to functions.NAME as tool
calls), whole and streamed, alone and together as the chat layer runs them, and the text they
read as the detokenizer writes it for a tokenizer that has the harmony special tokens (the
o200k_harmony tokenizer cannot be downloaded here)."""

import json
import re

import msgspec
import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.entrypoints.openai.chat_utils import ChoiceParser
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, to_sampling_params
from jaxserve.entrypoints.openai.tool_parsers import ToolParserManager
from jaxserve.reasoning import ReasoningParserManager, harmony
from tests.helpers import byte_level_tokenizer

A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
# completion text -> (reasoning, content after the reasoning parser, calls, content after both)
CASES = {
    "answer": (
        f"{A}User wants 2+2.<|end|>{F}It is 4.<|return|>", "User wants 2+2.", "It is 4.", [],
        "It is 4.",
    ),
    # the engine stops at <|call|>, which is not in the text
    "call": (
        f'{A}Need the weather.<|end|>{CALL_HEADER}<|message|>{{"city":"Paris"}}',
        "Need the weather.",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>"
        '{"city":"Paris"}',
        [("get_weather", {"city": "Paris"})], None,
    ),
    # a preamble to the user, then a call whose recipient comes before the channel
    "preamble_call": (
        '<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions.'
        'lookup<|channel|>commentary json<|message|>{"q": "x", "n": 2}<|call|>',
        None,
        "Let me check.<|start|>assistant to=functions.lookup<|channel|>commentary<|message|>"
        '{"q": "x", "n": 2}<|call|>',
        [("lookup", {"q": "x", "n": 2})], "Let me check.",
    ),
    "two_thoughts": (
        f"{A}First.<|end|><|start|>assistant{A}Second.<|end|>{F}Done", "First.\nSecond.",
        "Done", [], "Done",
    ),
    "truncated_thought": (f"{A}Thinking about", "Thinking about", None, [], None),
    "plain": ("Just text.", None, "Just text.", [], "Just text."),
}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
         {"type": "function", "function": {"name": "lookup", "parameters": {}}}]  # fmt: skip
SPECIAL = re.compile("(" + "|".join(map(re.escape, harmony.SPECIAL_TOKENS)) + ")")


def request(**body) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return msgspec.convert(body, ChatCompletionRequest)


def pieces(text: str, size: int) -> list[str]:
    """text as deltas: each special token whole (one token), other text `size` characters
    at a time."""
    out = []
    for part in SPECIAL.split(text):
        if SPECIAL.fullmatch(part):
            out.append(part)
        else:
            out += [part[i : i + size] for i in range(0, len(part), size)]
    return [p for p in out if p]


def calls_of(info) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


@pytest.mark.parametrize("case", CASES)
def test_reasoning_parser_whole_and_streamed(case):
    text, reasoning, content, _, _ = CASES[case]
    cls = ReasoningParserManager.get_reasoning_parser("openai_gptoss")
    assert cls(None).extract_reasoning(text, None) == (reasoning, content)
    for size in (1, 4, 1000):
        parser, got = cls(None), ["", ""]
        prev = ""
        for piece in [*pieces(text, size), None]:
            d = (parser.flush_streaming(prev) if piece is None
                 else parser.extract_reasoning_streaming(prev, prev + piece, piece))  # fmt: skip
            prev += piece or ""
            if d is not None:
                got[0] += d.reasoning or ""
                got[1] += d.content or ""
        assert got == [reasoning or "", content or ""], size


@pytest.mark.parametrize("case", CASES)
def test_tool_parser_on_the_reasoning_parsers_content_and_on_the_whole_text(case):
    text, _, content, calls, final_content = CASES[case]
    parser = ToolParserManager.get_tool_parser("openai")(None)
    for source in (content or "", text):  # with openai_gptoss, and without it
        info = parser.extract_tool_calls(source, request(tools=TOOLS))
        assert info.tools_called == bool(calls)
        assert calls_of(info) == calls
        assert (info.content or None) == final_content


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_chat_layer_streams_what_it_parses_whole(case, size):
    """Both parsers in the chat layer (ChoiceParser): the message of the whole text, and the
    same reasoning, content and calls from the streamed deltas."""
    text, reasoning, _, calls, final_content = CASES[case]
    req = request(tools=TOOLS, tool_choice="auto")
    make = lambda: ChoiceParser(  # noqa: E731
        req, ToolParserManager.get_tool_parser("openai"),
        ReasoningParserManager.get_reasoning_parser("openai_gptoss"), None,
    )  # fmt: skip
    message, called = make().full(text)
    assert (message.reasoning, message.content) == (reasoning, final_content)
    assert called == bool(calls) and calls_of(message) == calls
    got = streamed(make(), pieces(text, size))
    assert got == (reasoning or "", final_content or "", calls)


def streamed(parser, pieces) -> tuple[str, str, list[tuple[str, dict]]]:
    """A ChoiceParser fed `pieces` then finished -> (reasoning, content, [(name, args)])."""
    reasoning, content, calls = "", "", {}
    for d in [*(parser.delta(p, []) for p in pieces), parser.finish()]:
        if d is None:
            continue
        reasoning += d.reasoning or ""
        content += d.content or ""
        for c in d.tool_calls:
            entry = calls.setdefault(c.index, ["", ""])
            entry[0] += c.function.name or ""
            entry[1] += c.function.arguments or ""
    return reasoning, content, [(n, json.loads(a)) for n, a in calls.values()]


@pytest.fixture(scope="module")
def harmony_tokenizer():
    """A byte-level tokenizer with gpt-oss's harmony tokens as special tokens."""
    specials = [t for t in harmony.SPECIAL_TOKENS if t != "<|return|>"]
    return byte_level_tokenizer(specials, "<|return|>")


def test_parsers_keep_special_tokens_and_the_detokenizer_writes_them_unspaced(harmony_tokenizer):
    """The parsers' adjust_request keeps harmony's special tokens in the text, with no space
    between two of them: the text the detokenizer builds token by token is the text the
    model's tokens spell, which both parsers read."""
    text, reasoning, _, calls, final_content = CASES["call"]
    req = request(tools=TOOLS)
    req = ToolParserManager.get_tool_parser("openai")(harmony_tokenizer).adjust_request(req)
    cls = ReasoningParserManager.get_reasoning_parser("openai_gptoss")
    req = cls(harmony_tokenizer).adjust_request(req)
    params = to_sampling_params(req, {}, max_tokens=16, logprobs=None)
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens
    ids = harmony_tokenizer(text, add_special_tokens=False).input_ids
    assert harmony_tokenizer.convert_tokens_to_ids("<|message|>") in ids
    prompt = harmony_tokenizer("<|start|>assistant", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(harmony_tokenizer, prompt, params)
    for token in ids:
        detok.update([token])
    assert detok.output_text == text
    message, called = ChoiceParser(
        req, ToolParserManager.get_tool_parser("openai"), cls, harmony_tokenizer
    ).full(detok.output_text)  # fmt: skip
    assert message.reasoning == reasoning and called and calls_of(message) == calls


def test_structured_outputs_bind_after_the_final_channel_opens(harmony_tokenizer):
    """is_reasoning_end (structured outputs constrain only the answer): not in the analysis
    channel, yes once the final message's header is complete; the content ids are the ones
    after it."""
    parser = ReasoningParserManager.get_reasoning_parser("openai_gptoss")(harmony_tokenizer)
    encode = lambda s: harmony_tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    thinking = encode(f"{A}Let me think")
    assert not parser.is_reasoning_end(thinking)
    assert not parser.is_reasoning_end(encode(f"{A}x<|end|><|start|>assistant<|channel|>final"))
    answer = encode(f"{A}x<|end|>{F}")
    assert parser.is_reasoning_end(answer)
    assert parser.extract_content_ids(answer + encode('{"a": 1}')) == encode('{"a": 1}')
    assert parser.extract_content_ids(thinking) == []
