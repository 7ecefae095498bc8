"""Qwen3-Coder's XML tool calls as vLLM's `qwen3_xml` parser reads them.

The format and the reading are qwen3_coder's (qwen3coder_tool_parser.py); the one difference
is the typing: a parameter whose schema type is none of the kinds the parser knows (strings,
integers, numbers, booleans, objects, arrays) is a string here, where qwen3_coder tries it as a
JSON or Python literal.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxserve.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser


@ToolParserManager.register_module("qwen3_xml")
class Qwen3XMLToolParser(Qwen3CoderToolParser):
    loose_types = False
