"""DeepSeek-V3.1 tool calls (`deepseek_v31`): V3's section of calls (deepseekv3_tool_parser.py)
with a shorter call, the name then the arguments' JSON object:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...

While streaming, a call is named once its separator token arrives.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxserve.entrypoints.openai.tool_parsers.deepseekv3_tool_parser import (
    SEP,
    DeepSeekToolParserBase,
    name_of,
)


@ToolParserManager.register_module("deepseek_v31")
class DeepSeekV31ToolParser(DeepSeekToolParserBase):
    def _header(self, text: str, pos: int) -> tuple[str, int, None] | None:
        sep = text.find(SEP, pos)
        if sep < 0:
            return None
        name = name_of(text[pos:sep])
        return None if name is None else (name, sep + len(SEP), None)
