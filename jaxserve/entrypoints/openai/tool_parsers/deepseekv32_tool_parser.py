"""DeepSeek-V3.2's tool calls (`deepseek_v32`, vLLM's name), in DSML after the content:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY2" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Qwen3-Coder's named-parameter format with other markers (qwen3coder_tool_parser.py reads
both), each value the text between its markers (no newline trimmed), typed by its `string`
attribute as vLLM types it: "true" the text as it is,
"false" (or none) the text as JSON, else as it is. While streaming, a string value goes out as
it is written; other values once they end.
"""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxserve.entrypoints.openai.tool_parsers.param_values import json_value
from jaxserve.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import (
    Markers,
    Qwen3CoderToolParser,
)

DSML = "｜DSML｜"
DEEPSEEK_V32 = Markers(
    call_start=f"<{DSML}function_calls>",
    function=f'<{DSML}invoke name="',
    parameter=f'<{DSML}parameter name="',
    name_end='">',
    function_end=f"</{DSML}invoke>",
    parameter_end=f"</{DSML}parameter>",
    call_end=f"</{DSML}function_calls>",
    trim=False,
)
_STRING_ATTR = '" string="'  # between a parameter's name and its attribute's value
RAW, JSON = "raw", "json"


@ToolParserManager.register_module("deepseek_v32")
class DeepSeekV32ToolParser(Qwen3CoderToolParser):
    markers = DEEPSEEK_V32

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep special tokens whenever tools may be called (as vLLM's: its tokenizer does not
        mark the DSML markers special, but the text around them may hold ones it does)."""
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def param(self, props: dict[str, Any], marked: str) -> tuple[str, str]:
        key, _, attr = marked.partition(_STRING_ATTR)
        return key, RAW if attr == "true" else JSON

    def typed(self, raw: str, kind: str) -> Any:
        return raw if kind == RAW else json_value(raw)

    def stays_string(self, partial: str, kind: str) -> bool:
        return kind == RAW
