"""GLM-4.5 / 4.6 tool calls (`glm45`), and GLM-4.7's and GLM-5's (`glm47`: the same blocks,
the name often followed at once by its first `<arg_key>`, as vLLM reads both).

After the content, each call is a block

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

The name is the block's first line (up to a newline or the first `<arg_key>`); keys and values
are stripped of surrounding whitespace. As in vLLM, a value is a string when the tool's schema
in the request types it so, else read as JSON, then as a Python literal, else kept as written.
Every block needs its `</tool_call>` (a call cut off is no call); text between blocks is
ignored; blocks that do not read so are content. While streaming, a string value goes out as
it is written, other values once they end.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ExtractedToolCallInformation
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.param_values import (
    arguments,
    arguments_prefix,
    glm_is_string,
    glm_value,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import (
    content_before,
    find_first,
    hold_back_marker,
    skip_ws,
    streamed_content_before,
)

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"


class Block(NamedTuple):
    at: int  # where its `<tool_call>` is
    name: str
    pairs: list[tuple[str, str]]  # (key, stripped value) of the finished arguments
    open_pair: tuple[str, str] | None  # (key, certain start of the value) of an open one
    end: int | None  # the index past its `</tool_call>`, None while open


class _Malformed(ValueError):
    pass


def read_block(text: str, at: int, final: bool) -> Block | None:
    """The block whose `<tool_call>` is at `at`; None while its name is not certain (or, when
    `final`, if it is not closed). _Malformed if it cannot become a call."""
    body = at + len(CALL_START)
    name_end = find_first(text, ("\n", KEY_START, CALL_END), body)
    if name_end < 0:
        return None
    name = text[body:name_end].strip()
    if not name or "<" in name:
        raise _Malformed("no name")
    pairs: list[tuple[str, str]] = []
    pos = name_end
    while True:
        pos = skip_ws(text, pos)
        rest = text[pos:]
        if rest.startswith(CALL_END):
            return Block(at, name, pairs, None, pos + len(CALL_END))
        if not rest.startswith(KEY_START):
            if final or not (KEY_START.startswith(rest) or CALL_END.startswith(rest)):
                raise _Malformed("expected a key")
            return Block(at, name, pairs, None, None)
        key_end = text.find(KEY_END, pos)
        value_at = skip_ws(text, key_end + len(KEY_END)) if key_end >= 0 else len(text)
        key = text[pos + len(KEY_START) : key_end].strip() if key_end >= 0 else ""
        if key_end < 0 or not text.startswith(VALUE_START, value_at):
            if final or text[value_at:] and not VALUE_START.startswith(text[value_at:]):
                raise _Malformed("expected a value")
            return Block(at, name, pairs, None, None)
        value_end = text.find(VALUE_END, value_at)
        if value_end < 0:
            if final:
                raise _Malformed("an open value")
            value = hold_back_marker(text[value_at + len(VALUE_START) :], VALUE_END)
            return Block(at, name, pairs, (key, value.strip()), None)
        pairs.append((key, text[value_at + len(VALUE_START) : value_end].strip()))
        pos = value_end + len(VALUE_END)


@ToolParserManager.register_module(["glm45", "glm47"])
class Glm4MoeModelToolParser(ToolParser):
    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """As vLLM: keep special tokens whenever tools may be called."""
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def _values(self, block: Block, request: ChatCompletionRequest | None) -> list:
        return [(k, glm_value(v, glm_is_string(request, block.name, k))) for k, v in block.pairs]

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        at = model_output.find(CALL_START)
        if at < 0:
            return no_tool_calls(model_output)
        tool_calls = []
        while at >= 0:
            try:
                block = read_block(model_output, at, final=True)
            except _Malformed:
                return no_tool_calls(model_output)
            if block is None or block.end is None:
                return no_tool_calls(model_output)
            tool_calls.append(
                self.make_tool_call(block.name, arguments(self._values(block, request)))
            )
            at = model_output.find(CALL_START, block.end)
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=tool_calls,
            content=content_before(model_output, CALL_START),
        )

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        content, at = streamed_content_before(text, CALL_START)
        calls: list[tuple[str, str]] = []
        memo = self.scan_memo(text)
        while at >= 0:
            done = memo.entries.get(("block", at))
            if done is None:
                try:
                    block = read_block(text, at, final=False)
                except _Malformed:
                    break
                if block is None:
                    break
                if block.end is None:  # open: the finished values, then a string as it comes
                    values = self._values(block, self.request)
                    open_string = None
                    if block.open_pair and glm_is_string(
                        self.request, block.name, block.open_pair[0]
                    ):
                        open_string = block.open_pair
                    calls.append((block.name, arguments_prefix(values, open_string)))
                    break
                done = (block.name, arguments(self._values(block, self.request))), block.end
                memo.entries["block", at] = done
            calls.append(done[0])
            at = text.find(CALL_START, done[1])
        return content, calls
