"""MiniMax-M2's tool calls (`minimax_m2`, vLLM's name). The model writes them after the
content as

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

Qwen3-Coder's named-parameter format with other markers (qwen3coder_tool_parser.py reads
both): a value is the text between a parameter's markers less one newline at each end, typed
by the tool's schema in the request; a call still open when the text ends is a call with the
values written so far; while streaming a string value goes out as it is written.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxserve.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import (
    Markers,
    Qwen3CoderToolParser,
)

MINIMAX_M2 = Markers(
    call_start="<minimax:tool_call>",
    function='<invoke name="',
    parameter='<parameter name="',
    name_end='">',
    function_end="</invoke>",
    parameter_end="</parameter>",
    call_end="</minimax:tool_call>",
)


@ToolParserManager.register_module("minimax_m2")
class MiniMaxM2ToolParser(Qwen3CoderToolParser):
    markers = MINIMAX_M2
