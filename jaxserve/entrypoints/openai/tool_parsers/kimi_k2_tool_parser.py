"""Kimi-K2 tool calls (`kimi_k2`).

After the content, one section of calls between Kimi's special tokens:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|><|tool_call_begin|>...<|tool_call_end|><|tool_calls_section_end|>

(the singular `<|tool_call_section_begin|>` too). As in vLLM, the call's id is the model's own
`functions.NAME:IDX` and its name what is between the last "." before the ":" and the ":".
The section is read as section_tool_parser.py reads it. While streaming, a call is named once
its argument token arrives.
"""

from __future__ import annotations

import re

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxserve.entrypoints.openai.tool_parsers.section_tool_parser import SectionToolParser

SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_ID = re.compile(r"\s*([^<]+:\d+)\s*")


@ToolParserManager.register_module("kimi_k2")
class KimiK2ToolParser(SectionToolParser):
    section_begins, call_begin, call_end = SECTION_BEGINS, CALL_BEGIN, CALL_END
    header_markers = (ARGUMENT_BEGIN,)

    def _header(self, text: str, pos: int) -> tuple[str, int, str] | None:
        """(name, where the arguments start, the call's id); None while its argument token has
        not come (or the header is not an id)."""
        arg = text.find(ARGUMENT_BEGIN, pos)
        if arg < 0:
            return None
        m = _CALL_ID.fullmatch(text, pos, arg)
        if m is None:
            return None
        call_id = m.group(1)
        name = call_id.split(":")[0].split(".")[-1]
        return (name, arg + len(ARGUMENT_BEGIN), call_id) if name else None
