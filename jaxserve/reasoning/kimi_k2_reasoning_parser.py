"""Kimi-K2 (`kimi_k2`): `[<think>]reasoning</think>content`, as vLLM's current parser.

Thinking is on unless chat_template_kwargs sets `thinking` false (then all of the output is
content). On, the reasoning is implied from the first token (a leading `<think>` stripped) and
ends at the first `</think>`, at `</thinking>` (which the model sometimes writes instead), or
where a tool-call section begins (`<|tool_calls_section_begin|>`: Kimi-K2-Thinking may call
tools without closing its thought), which stays in the content for the `kimi_k2` tool parser.
Without any of them all of the output is reasoning.
"""

from __future__ import annotations

from typing import Any

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParserManager
from jaxserve.reasoning.deepseek_v3_reasoning_parser import DeepSeekV3ReasoningParser


@ReasoningParserManager.register_module("kimi_k2")
class KimiK2ReasoningParser(DeepSeekV3ReasoningParser):
    extra_end_tokens = ("</thinking>",)
    content_start_tokens = ("<|tool_calls_section_begin|>",)

    def _thinking(self, kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("thinking", True))
