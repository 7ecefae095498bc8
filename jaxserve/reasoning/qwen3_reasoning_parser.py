"""Qwen3 / Qwen3.5: `[<think>]reasoning</think>content`, as vLLM's current qwen3 parser.

Thinking is on unless `chat_template_kwargs={"enable_thinking": False}` (given to the
constructor, as vLLM's serving layer does, or on the request passed to `extract_reasoning`):

- on (default): Qwen3 models up to 2507 generate `<think>` themselves, Qwen3.5 and the thinking
  models get it in the prompt; either way the text before the first `</think>` is reasoning
  (a leading `<think>` stripped) and, as in vLLM, an output without `</think>` was truncated
  mid-thought: all of it is reasoning, content None.
- off: the template closes an empty `<think>\\n\\n</think>` in the prompt, so the output is all
  content. Only an output that itself opens with `<think>` still gets its reasoning split off.
"""

from __future__ import annotations

from typing import Any

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning is implied unless enable_thinking is False."""

    def _implicit_reasoning(self, request: Any = None) -> bool:
        kwargs = getattr(request, "chat_template_kwargs", None) or self.chat_template_kwargs
        return kwargs.get("enable_thinking", True) is not False
