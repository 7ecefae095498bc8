"""DeepSeek-V3 / R1-0528 tool calls (`deepseek_v3`); V3.1's form is deepseekv31_tool_parser.py.

After the content, one section of calls between DeepSeek's special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The section is read as section_tool_parser.py reads it. While streaming, a call is named at
the end of its name's line and its arguments go out as they are written.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxserve.entrypoints.openai.tool_parsers.section_tool_parser import SectionToolParser
from jaxserve.entrypoints.openai.tool_parsers.utils import skip_ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE = "```"
_JSON_FENCE = _FENCE + "json"


class DeepSeekToolParserBase(SectionToolParser):
    """The section and call markers DeepSeek's models share; subclasses read a call's header."""

    section_begins = (CALLS_BEGIN,)
    call_begin, call_end, header_markers = CALL_BEGIN, CALL_END, (SEP,)


def name_of(text: str) -> str | None:
    """A call's name as written, None if it is empty or holds a DeepSeek token."""
    name = text.strip()
    return name if name and "<｜" not in name else None


@ToolParserManager.register_module("deepseek_v3")
class DeepSeekV3ToolParser(DeepSeekToolParserBase):
    def _header(self, text: str, pos: int) -> tuple[str, int | None, None] | None:
        """`TYPE<｜tool▁sep｜>NAME\\n```json\\n`: the name ends at the line's end."""
        sep = text.find(SEP, pos)
        if sep < 0 or "<｜" in text[pos:sep]:
            return None
        line_end = text.find("\n", sep + len(SEP))
        if line_end < 0:
            return None
        name = name_of(text[sep + len(SEP) : line_end])
        if name is None:
            return None
        pos = skip_ws(text, line_end)
        if text.startswith(_JSON_FENCE, pos):
            return name, pos + len(_JSON_FENCE), None
        if _JSON_FENCE.startswith(text[pos : pos + len(_JSON_FENCE)]):  # may still come
            return name, None, None
        return name, pos, None  # no fence: the JSON itself

    def _close(self, text: str, pos: int) -> int | None:
        """After the JSON: the closing fence, then the end token."""
        pos = skip_ws(text, pos)
        if text.startswith(_FENCE, pos):
            pos += len(_FENCE)
        elif _FENCE.startswith(text[pos:]):
            return None
        return super()._close(text, pos)
