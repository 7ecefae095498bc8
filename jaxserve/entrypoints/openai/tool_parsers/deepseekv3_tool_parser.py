"""DeepSeek-V3 / R1-0528 tool calls (`deepseek_v3`); V3.1's form is deepseekv31_tool_parser.py.

After the content, one section of calls between DeepSeek's special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Each call's arguments are a JSON object. A call needs its end token (one cut off by max_tokens
is no call); a section that does not read so is content. What follows the section's last call
is ignored. While streaming, a call is named at the end of its name's line and its arguments
go out as they are written.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ExtractedToolCallInformation
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import (
    arguments_json,
    content_before,
    json_prefix,
    read_json,
    skip_ws,
    streamed_content_before,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE = "```"
_JSON_FENCE = _FENCE + "json"


class DeepSeekToolParserBase(ToolParser):
    """The section and call markers DeepSeek's models share; subclasses read a call's header
    (`_header`) and what closes its arguments (`_close`)."""

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep special tokens when the tokenizer marks the call markers as such."""
        if (
            request.tools
            and request.tool_choice != "none"
            and self.marks_special(CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END)
        ):
            request.skip_special_tokens = False
        return request

    def _header(self, text: str, pos: int) -> tuple[str, int | None] | None:
        """For a call whose header starts at `pos` (after its begin token): (name, where the
        arguments start or None while that is not certain), None while the name is not."""
        raise NotImplementedError

    def _close(self, text: str, pos: int) -> int | None:
        """The index past the call's end token when the arguments end at `pos`, else None."""
        pos = skip_ws(text, pos)
        return pos + len(CALL_END) if text.startswith(CALL_END, pos) else None

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        start = model_output.find(CALLS_BEGIN)
        if start < 0:
            return no_tool_calls(model_output)
        tool_calls = []
        pos = skip_ws(model_output, start + len(CALLS_BEGIN))
        while model_output.startswith(CALL_BEGIN, pos):
            header = self._header(model_output, pos + len(CALL_BEGIN))
            if header is None or header[1] is None:
                return no_tool_calls(model_output)
            name, at = header
            try:
                value, end = read_json(model_output, at)
            except ValueError:
                return no_tool_calls(model_output)
            args, close = arguments_json(value), self._close(model_output, end)
            if args is None or close is None:
                return no_tool_calls(model_output)
            tool_calls.append(self.make_tool_call(name, args))
            pos = skip_ws(model_output, close)
        if not tool_calls:
            return no_tool_calls(model_output)
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=tool_calls,
            content=content_before(model_output, CALLS_BEGIN),
        )

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        content, start = streamed_content_before(text, CALLS_BEGIN)
        calls: list[tuple[str, str]] = []
        if start < 0:
            return content, calls
        memo = self.scan_memo(text)
        pos = skip_ws(text, start + len(CALLS_BEGIN))
        while text.startswith(CALL_BEGIN, pos):
            header = self._header(text, pos + len(CALL_BEGIN))
            if header is None:
                break
            name, at = header
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
        return content, calls


def _name(text: str) -> str | None:
    """A call's name as written, None if it is empty or holds a DeepSeek token."""
    name = text.strip()
    return name if name and "<｜" not in name else None


@ToolParserManager.register_module("deepseek_v3")
class DeepSeekV3ToolParser(DeepSeekToolParserBase):
    def _header(self, text: str, pos: int) -> tuple[str, int | None] | None:
        """`TYPE<｜tool▁sep｜>NAME\\n```json\\n`: the name ends at the line's end."""
        sep = text.find(SEP, pos)
        if sep < 0 or "<｜" in text[pos:sep]:
            return None
        line_end = text.find("\n", sep + len(SEP))
        if line_end < 0:
            return None
        name = _name(text[sep + len(SEP) : line_end])
        if name is None:
            return None
        pos = skip_ws(text, line_end)
        if text.startswith(_JSON_FENCE, pos):
            return name, pos + len(_JSON_FENCE)
        if _JSON_FENCE.startswith(text[pos : pos + len(_JSON_FENCE)]):  # may still come
            return name, None
        return name, pos  # no fence: the JSON itself

    def _close(self, text: str, pos: int) -> int | None:
        """After the JSON: the closing fence, then the end token."""
        pos = skip_ws(text, pos)
        if text.startswith(_FENCE, pos):
            pos += len(_FENCE)
        elif _FENCE.startswith(text[pos:]):
            return None
        return super()._close(text, pos)
