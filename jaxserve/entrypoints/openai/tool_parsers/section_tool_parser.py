"""Tool calls in one section of marker tokens after the content, each call between its own
begin and end markers (DeepSeek-V3 / V3.1, Kimi K2): the section read once here, whole and
streamed; a family names its markers and reads a call's header (`_header`) and what closes its
arguments (`_close`).

Each call's arguments are a JSON object. A call needs its end marker (one cut off by
max_tokens is no call); a section that does not read so is content. What follows the
section's last call is ignored.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
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


class SectionToolParser(ToolParser):
    section_begins: tuple[str, ...]  # what opens the section (any of them)
    call_begin: str
    call_end: str
    header_markers: tuple[str, ...] = ()  # the family's other special tokens

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.call_ids: list[str | None] = []  # the model's ids of the calls read last

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep special tokens when the tokenizer marks the call markers as such."""
        markers = (*self.section_begins, self.call_begin, *self.header_markers, self.call_end)
        if request.tools and request.tool_choice != "none" and self.marks_special(*markers):
            request.skip_special_tokens = False
        return request

    def stream_tool_call_id(self, index: int) -> str:
        if index < len(self.call_ids) and self.call_ids[index] is not None:
            return self.call_ids[index]
        return self.new_tool_call_id()

    def _header(self, text: str, pos: int) -> tuple[str, int | None, str | None] | None:
        """For a call whose header starts at `pos` (after its begin marker): (name, where the
        arguments start or None while that is not certain, the model's id of the call or
        None), None while the name is not certain (or the header does not read)."""
        raise NotImplementedError

    def _close(self, text: str, pos: int) -> int | None:
        """The index past the call's end marker when the arguments end at `pos`, else None."""
        pos = skip_ws(text, pos)
        return pos + len(self.call_end) if text.startswith(self.call_end, pos) else None

    def _first_call(self, text: str, start: int) -> int:
        """Where the first call of the section starting at `start` begins."""
        marker = next(m for m in self.section_begins if text.startswith(m, start))
        return skip_ws(text, start + len(marker))

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        start = find_first(model_output, self.section_begins)
        if start < 0:
            return no_tool_calls(model_output)
        tool_calls = []
        pos = self._first_call(model_output, start)
        while model_output.startswith(self.call_begin, pos):
            header = self._header(model_output, pos + len(self.call_begin))
            if header is None or header[1] is None:
                return no_tool_calls(model_output)
            name, at, call_id = header
            try:
                value, end = read_json(model_output, at)
            except ValueError:
                return no_tool_calls(model_output)
            args, close = arguments_json(value), self._close(model_output, end)
            if args is None or close is None:
                return no_tool_calls(model_output)
            call = FunctionCall(name=name, arguments=args)
            tool_calls.append(ToolCall(function=call, id=call_id or self.new_tool_call_id()))
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
        content, start = streamed_content_before_any(text, self.section_begins)
        calls: list[tuple[str, str]] = []
        if start < 0:
            return content, calls
        memo = self.scan_memo(text)
        ids = []
        pos = self._first_call(text, start)
        while text.startswith(self.call_begin, pos):
            header = self._header(text, pos + len(self.call_begin))
            if header is None:
                break
            name, at, call_id = header
            ids.append(call_id)
            if at is None or not text.startswith("{", skip_ws(text, at)):
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
