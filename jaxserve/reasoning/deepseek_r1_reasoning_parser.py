"""DeepSeek-R1: `[<think>]reasoning</think>content`.

R1's chat template ends the prompt with `<think>\\n`, so the output usually starts straight with
the reasoning; R1-0528 and distills may repeat `<think>`, which is stripped. Everything before
the first `</think>` is reasoning; without `</think>` (a truncated output) all of it is.
"""

from __future__ import annotations

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning is implied from the first generated token (the base class's behaviour)."""
