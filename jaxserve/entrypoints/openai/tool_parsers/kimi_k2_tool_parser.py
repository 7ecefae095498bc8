"""Kimi-K2 tool calls (`kimi_k2`).

After the content, one section of calls between Kimi's special tokens:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|><|tool_call_begin|>...<|tool_call_end|><|tool_calls_section_end|>

(the singular `<|tool_call_section_begin|>` too). As in vLLM, the call's id is the model's own
`functions.NAME:IDX` and its name what is between the last "." before the ":" and the ":".
Arguments are a JSON object; a call needs its end token, and a section that does not read so
is content. While streaming, a call is named once its argument token arrives.
"""

from __future__ import annotations

import re

from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import (
    arguments_json,
    find_first,
    json_prefix,
    read_json,
    skip_ws,
    streamed_content_before_any,
)

SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_ID = re.compile(r"\s*([^<]+:\d+)\s*")


@ToolParserManager.register_module("kimi_k2")
class KimiK2ToolParser(ToolParser):
    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.call_ids: list[str] = []  # the model's ids of the calls read last

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep special tokens when the tokenizer marks the call markers as such."""
        if (
            request.tools
            and request.tool_choice != "none"
            and self.marks_special(*SECTION_BEGINS, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
        ):
            request.skip_special_tokens = False
        return request

    def stream_tool_call_id(self, index: int) -> str:
        if index < len(self.call_ids):
            return self.call_ids[index]
        return self.new_tool_call_id()

    @staticmethod
    def _header(text: str, pos: int) -> tuple[str, str, int] | None:
        """(id, name, where the arguments start) of the call whose header starts at `pos`;
        None while its argument token has not come (or the header is not an id)."""
        arg = text.find(ARGUMENT_BEGIN, pos)
        if arg < 0:
            return None
        m = _CALL_ID.fullmatch(text, pos, arg)
        if m is None:
            return None
        call_id = m.group(1)
        name = call_id.split(":")[0].split(".")[-1]
        return (call_id, name, arg + len(ARGUMENT_BEGIN)) if name else None

    @staticmethod
    def _close(text: str, pos: int) -> int | None:
        pos = skip_ws(text, pos)
        return pos + len(CALL_END) if text.startswith(CALL_END, pos) else None

    def _section(self, text: str, start: int) -> int:
        """Where the first call of the section starting at `start` begins."""
        marker = next(m for m in SECTION_BEGINS if text.startswith(m, start))
        return skip_ws(text, start + len(marker))

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        start = find_first(model_output, SECTION_BEGINS)
        if start < 0:
            return no_tool_calls(model_output)
        tool_calls = []
        pos = self._section(model_output, start)
        while model_output.startswith(CALL_BEGIN, pos):
            header = self._header(model_output, pos + len(CALL_BEGIN))
            if header is None:
                return no_tool_calls(model_output)
            call_id, name, at = header
            try:
                value, end = read_json(model_output, at)
            except ValueError:
                return no_tool_calls(model_output)
            args, close = arguments_json(value), self._close(model_output, end)
            if args is None or close is None:
                return no_tool_calls(model_output)
            tool_calls.append(ToolCall(FunctionCall(name, args), id=call_id))
            pos = skip_ws(model_output, close)
        if not tool_calls:
            return no_tool_calls(model_output)
        self.call_ids = [tc.id for tc in tool_calls]
        content = model_output[:start]
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=tool_calls,
            content=content if content.strip() else None,
        )

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        content, start = streamed_content_before_any(text, SECTION_BEGINS)
        calls: list[tuple[str, str]] = []
        if start < 0:
            return content, calls
        memo = self.scan_memo(text)
        ids = []
        pos = self._section(text, start)
        while text.startswith(CALL_BEGIN, pos):
            header = self._header(text, pos + len(CALL_BEGIN))
            if header is None:
                break
            call_id, name, at = header
            ids.append(call_id)
            if not text.startswith("{", skip_ws(text, at)):
                calls.append((name, ""))  # arguments not begun (or not an object): held
                break
            try:
                args, end = json_prefix(text, at, memo)
            except ValueError:
                calls.append((name, ""))
                break
            calls.append((name, args))
            close = None if end is None else self._close(text, end)
            if close is None:
                break
            pos = skip_ws(text, close)
        self.call_ids = ids
        return content, calls
