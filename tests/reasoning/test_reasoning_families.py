"""The `deepseek_v3`, `glm45`, `kimi_k2`, `minimax_m2` and `minimax_m2_append_think` reasoning
parsers: their thinking switches in chat_template_kwargs, the split of recorded-style outputs
whole and streamed (tags cut across deltas, and token by token with the tags' ids), and the
token-id checks; then each family's reasoning and tool parsers together in the chat layer."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from jaxserve.entrypoints.openai.chat_utils import ChoiceParser
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.tool_parsers import ToolParserManager
from jaxserve.reasoning import ReasoningParserManager
from tests.reasoning.test_harmony import streamed
from tests.reasoning.test_reasoning_parsers import FakeTokenizer, make, stream

ON = {"chat_template_kwargs": {"thinking": True}}
OFF = {"chat_template_kwargs": {"thinking": False}}
ENABLE_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
KIMI_SECTION = "<|tool_calls_section_begin|>"
KIMI_CALL = (
    f'{KIMI_SECTION}<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{{"tz": '
    '"UTC"}<|tool_call_end|><|tool_calls_section_end|>'
)

# (parser, constructor kwargs, model output, reasoning, content)
CASES = [
    # DeepSeek-V3.1: no thinking unless asked; then as deepseek_r1.
    ("deepseek_v3", {}, "The answer is 4.", None, "The answer is 4."),
    ("deepseek_v3", {}, "<think>x</think>y", None, "<think>x</think>y"),
    ("deepseek_v3", ON, "2 + 2: add them.</think>The answer is 4.", "2 + 2: add them.",
     "The answer is 4."),
    ("deepseek_v3", {"chat_template_kwargs": {"enable_thinking": True}}, "Still thinking",
     "Still thinking", None),
    ("deepseek_v3", OFF, "Hello</think>", None, "Hello</think>"),
    # GLM-4.5: thinking unless switched off.
    ("glm45", {}, "<think>The user greets me.</think>\nHello!", "The user greets me.", "\nHello!"),
    ("glm45", {}, "Thinking without an end", "Thinking without an end", None),
    ("glm45", ENABLE_OFF, "\nHello!", None, "\nHello!"),
    ("glm45", {"chat_template_kwargs": {"enable_thinking": False, "thinking": True}},
     "a</think>b", "a", "b"),
    # Kimi-K2: thinking unless thinking=False; a tool section ends it too.
    ("kimi_k2", {}, "<think>Need the time.</think>It is noon.", "Need the time.", "It is noon."),
    ("kimi_k2", {}, "Need the time." + KIMI_CALL, "Need the time.", KIMI_CALL),
    ("kimi_k2", {}, "Hmm.</thinking>Answer", "Hmm.", "Answer"),
    ("kimi_k2", {}, "Cut off while thinking", "Cut off while thinking", None),
    ("kimi_k2", OFF, "Plain answer <think>", None, "Plain answer <think>"),
    # MiniMax-M2: the prompt opens <think>; append_think keeps it all as content, <think> first.
    ("minimax_m2", {}, "Plan it.\n</think>\n\nDone.", "Plan it.\n", "\n\nDone."),
    ("minimax_m2", {}, "Cut off", "Cut off", None),
    ("minimax_m2_append_think", {}, "Plan it.\n</think>\nDone.", None,
     "<think>Plan it.\n</think>\nDone."),
]  # fmt: skip
TAGS = ("<think>", "</think>", "</thinking>", KIMI_SECTION)


def chunkings(text: str):
    for n in (1, 3, 7):
        yield [text[i : i + n] for i in range(0, len(text), n)]
    yield [text]
    for tag in TAGS:
        for m in re.finditer(re.escape(tag), text):
            for k in range(1, len(tag)):
                yield [text[: m.start() + k], text[m.start() + k :]]


@pytest.mark.parametrize("name,kwargs,output,reasoning,content", CASES)
def test_whole_and_streamed(name, kwargs, output, reasoning, content):
    assert make(name, kwargs).extract_reasoning(output, None) == (reasoning, content)
    for chunks in chunkings(output):
        got_r, got_c, _ = stream(make(name, kwargs), chunks)
        assert (got_r, got_c) == (reasoning or "", content or ""), chunks


class TagTokenizer(FakeTokenizer):
    """FakeTokenizer with <think>, </think>, </thinking> and Kimi's section token whole."""

    TAGS = {"<think>": 1000, "</think>": 1001, "</thinking>": 1002, KIMI_SECTION: 1003}

    def __init__(self) -> None:
        super().__init__(with_tags=False)
        self.vocab |= self.TAGS
        self.inv = {i: t for t, i in self.vocab.items()}

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in re.split("(" + "|".join(map(re.escape, self.TAGS)) + ")", text):
            ids += [self.vocab[piece]] if piece in self.TAGS else [self.vocab[c] for c in piece]
        return ids


@pytest.mark.parametrize("name,kwargs,output,reasoning,content", CASES)
def test_token_by_token_with_tag_ids(name, kwargs, output, reasoning, content):
    tok = TagTokenizer()
    ids = tok.encode(output)
    chunks = [tok.decode([i]) for i in ids]
    got_r, got_c, _ = stream(make(name, kwargs, tok), chunks, [[i] for i in ids])
    assert (got_r, got_c) == (reasoning or "", content or "")


def test_token_id_checks():
    tok = TagTokenizer()
    enc = tok.encode
    v3_off, v3_on = make("deepseek_v3", {}, tok), make("deepseek_v3", ON, tok)
    assert v3_off.is_reasoning_end(enc("<think>hm")) and v3_off.is_reasoning_end_text("<think>")
    assert v3_off.extract_content_ids(enc("<think>a</think>b")) == enc("<think>a</think>b")
    assert not v3_on.is_reasoning_end(enc("hm")) and v3_on.is_reasoning_end(enc("a</think>"))
    kimi = make("kimi_k2", {}, tok)
    assert not kimi.is_reasoning_end(enc("thinking"))
    assert kimi.is_reasoning_end(enc("a" + KIMI_SECTION)) and kimi.is_reasoning_end(
        enc("a</thinking>")
    )
    assert kimi.is_reasoning_end_text("a" + KIMI_SECTION) and not kimi.is_reasoning_end_text("a")
    # the section token starts the content; </think> is dropped
    assert kimi.extract_content_ids(enc("a" + KIMI_SECTION + "x")) == enc(KIMI_SECTION + "x")
    assert kimi.extract_content_ids(enc("a</think>x" + KIMI_SECTION)) == enc("x" + KIMI_SECTION)
    assert kimi.extract_content_ids(enc("still thinking")) == []
    glm = make("glm45", {}, tok)
    assert not glm.is_reasoning_end(enc("<think>a")) and glm.is_reasoning_end(enc("a</think>"))


def test_registered_names():
    names = {"deepseek_v3", "glm45", "kimi_k2", "minimax_m2", "minimax_m2_append_think"}
    assert names <= set(ReasoningParserManager.list_names())


# ---------------------------------------------------------------------- with the tool parsers
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}]  # fmt: skip
DS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"tz\": \"UTC\"}"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")  # fmt: skip
GLM = "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>"
QWEN = (
    "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
)
MINIMAX = ('<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="tz">UTC</parameter>\n'
           "</invoke>\n</minimax:tool_call>")  # fmt: skip
# (reasoning parser, tool parser, chat_template_kwargs, output, reasoning, content)
TOGETHER = [
    ("deepseek_v3", "deepseek_v31", {"thinking": True}, "Time zone?</think>Let me see." + DS,
     "Time zone?", "Let me see."),
    ("deepseek_v3", "deepseek_v31", None, DS, None, None),
    ("glm45", "glm45", None, "<think>Need the time.</think>\n" + GLM, "Need the time.", None),
    ("kimi_k2", "kimi_k2", None, "<think>Need the time." + KIMI_CALL, "Need the time.", None),
    ("kimi_k2", "kimi_k2", {"thinking": False}, "Sure." + KIMI_CALL, None, "Sure."),
    ("qwen3", "qwen3_coder", None, "<think>\nhm\n</think>\n\n" + QWEN, "\nhm\n", None),
    ("minimax_m2", "minimax_m2", None, "Need the time.</think>\n" + MINIMAX, "Need the time.",
     None),
    ("minimax_m2_append_think", "minimax_m2", None, "hm</think>\n" + MINIMAX, None,
     "<think>hm</think>\n"),
]  # fmt: skip


@pytest.mark.parametrize("reasoner,tools,kwargs,output,reasoning,content", TOGETHER)
def test_reasoning_then_tool_calls_in_the_chat_layer(reasoner, tools, kwargs, output,
                                                     reasoning, content):  # fmt: skip
    body = {"messages": [{"role": "user", "content": "time?"}], "tools": TOOLS,
            "chat_template_kwargs": kwargs}  # fmt: skip
    req = msgspec.convert(body, ChatCompletionRequest)

    def parser():
        return ChoiceParser(
            req,
            ToolParserManager.get_tool_parser(tools),
            ReasoningParserManager.get_reasoning_parser(reasoner),
            None,
        )

    message, called = parser().full(output)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert called and calls == [("get_time", {"tz": "UTC"})]
    assert (message.reasoning, message.content or None) == (reasoning, content)
    for size in (1, 4, len(output)):
        pieces = [output[i : i + size] for i in range(0, len(output), size)]
        got_reasoning, got_content, got_calls = streamed(parser(), pieces)
        assert (got_reasoning or None, got_content or None) == (reasoning, content), size
        assert got_calls == calls, size
