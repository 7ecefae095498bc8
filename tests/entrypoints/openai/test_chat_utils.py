"""The chat layer's parsing of one choice, without a model: reasoning, then tool calls, whole
and streamed (the default model writes neither <think> nor tool-call markup)."""

import json

import msgspec
import pytest

from jaxserve.entrypoints.openai.chat_utils import (
    ChoiceParser,
    check_tools,
    content_format,
    template_messages,
    tool_choice_constraint,
)
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.tool_parsers import ToolParserManager
from jaxserve.reasoning import ReasoningParserManager

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}]
# What a Qwen-style model writes with deepseek_r1 reasoning and hermes tool calls.
RECORDED = (
    "The user wants the weather, so I call the tool.</think>Let me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def request(**body) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **body},
                           ChatCompletionRequest)  # fmt: skip


def parser(req: ChatCompletionRequest, tools="hermes", reasoning="deepseek_r1") -> ChoiceParser:
    return ChoiceParser(
        req,
        ToolParserManager.get_tool_parser(tools) if tools else None,
        ReasoningParserManager.get_reasoning_parser(reasoning) if reasoning else None,
        None,
    )


def streamed(p: ChoiceParser, text: str, size: int) -> dict:
    """Feed text in pieces of `size` characters; gather what the deltas carry."""
    got = {"reasoning": "", "content": "", "calls": {}}
    deltas = [p.delta(text[i : i + size], []) for i in range(0, len(text), size)]
    for d in [*deltas, p.finish()]:
        if d is None:
            continue
        got["reasoning"] += d.reasoning or ""
        got["content"] += d.content or ""
        assert d.reasoning_content == d.reasoning
        for c in d.tool_calls:
            call = got["calls"].setdefault(c.index, ["", ""])
            if c.function and c.function.name:
                call[0] += c.function.name
            if c.function and c.function.arguments:
                call[1] += c.function.arguments
    return got


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_reasoning_then_auto_tool_call_streams_as_it_parses_whole(size):
    req = request(tools=TOOLS, tool_choice="auto")
    message, called = parser(req).full(RECORDED)
    assert called and message.reasoning.startswith("The user wants")
    assert message.content == "Let me check."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    p = parser(req)
    got = streamed(p, RECORDED, size)
    assert p.tools_called
    assert got["reasoning"] == message.reasoning and got["content"] == message.content
    assert got["calls"] == {0: ["get_weather", call.function.arguments]}


def test_named_and_required_choices_parse_the_constrained_json():
    named = request(tools=TOOLS, tool_choice={"type": "function",
                                              "function": {"name": "get_weather"}})  # fmt: skip
    message, called = parser(named, tools=None, reasoning=None).full('{"city": "Rome"}')
    assert (
        not called
        and message.content == ""
        and message.tool_calls[0].function.name == ("get_weather")
    )
    got = streamed(parser(named, tools=None, reasoning=None), '{"city": "Rome"}', 4)
    assert got["calls"] == {0: ["get_weather", '{"city": "Rome"}']}

    required = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert tool_choice_constraint(required).json["maxItems"] == 1
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    message, called = parser(required, tools=None, reasoning=None).full(text)
    assert called and message.content == ""  # (vLLM's, not null)
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}


def test_without_parsers_text_is_content_and_reasoning_can_be_left_out():
    p = parser(request(), tools=None, reasoning=None)
    assert streamed(p, "plain <think>text</think>", 2)["content"] == "plain <think>text</think>"
    message, called = parser(request(), tools=None).full("thinking</think>answer")
    assert (message.reasoning, message.content, called) == ("thinking", "answer", False)


def test_tool_rules_and_history_for_the_template():
    with pytest.raises(ValueError, match="requires --enable-auto-tool-choice"):
        check_tools(request(tools=TOOLS, tool_choice="auto"), auto_tools=False)
    check_tools(request(tools=TOOLS), auto_tools=False)  # auto by default: allowed, unparsed
    with pytest.raises(ValueError, match="tool_choice must be none, auto, required"):
        check_tools(request(tools=TOOLS, tool_choice={"type": "function", "function": 5}),
                    auto_tools=True)  # fmt: skip
    history = [
        {"role": "assistant", "content": None, "reasoning_content": "hm",
         "tool_calls": [{"id": "1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "Sunny"}]},
    ]  # fmt: skip
    assistant, tool = template_messages(history, "string")
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert assistant["reasoning"] == "hm" and "reasoning_content" not in assistant
    assert assistant["thinking"] == "hm"  # gpt-oss's template reads it
    assert tool == {"role": "tool", "tool_call_id": "1", "content": "Sunny"}
    assert template_messages(history, "openai")[1]["content"] == [{"type": "text", "text": "Sunny"}]
    assert content_format("{% for part in message['content'] %}", "auto") == "openai"
    assert content_format("{{ message['content'] }}", "auto") == "string"


def test_reasoning_effort_reaches_the_template_and_is_checked():
    """OpenAI's reasoning_effort is the template's `reasoning_effort` (gpt-oss's template
    writes it into the system message); chat_template_kwargs may override it; another value
    is refused, naming the field."""
    from jaxserve.entrypoints.openai.serving_chat import template_kwargs

    assert template_kwargs(request()) is None
    assert template_kwargs(request(reasoning_effort="high")) == {"reasoning_effort": "high"}
    both = request(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "medium"})
    assert template_kwargs(both) == {"reasoning_effort": "medium"}
    with pytest.raises(msgspec.ValidationError, match="reasoning_effort"):
        request(reasoning_effort="extreme")
