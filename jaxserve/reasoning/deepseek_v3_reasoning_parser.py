"""DeepSeek-V3.1 / V3.2 (`deepseek_v3`): thinking is a switch of the chat template.

Thinking is on only when chat_template_kwargs (the constructor's, which the serving layer
fills with the request's over --default-chat-template-kwargs) sets `thinking` or
`enable_thinking` true; the template then opens `<think>` in the prompt and the output is read
as deepseek_r1 reads it (the text before the first `</think>` is reasoning; without one, all of
it). Off (the default), the template closes the thought in the prompt and all of the output is
content, tags and all.
"""

from __future__ import annotations

from typing import Any

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("deepseek_v3")
class DeepSeekV3ReasoningParser(ReasoningParser):
    default_thinking = False  # when chat_template_kwargs sets neither switch

    def __init__(self, tokenizer: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self.thinking = self._thinking(self.chat_template_kwargs)

    def _thinking(self, kwargs: dict[str, Any]) -> bool:
        thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
        if thinking is None and enable is None:
            return self.default_thinking
        return bool(thinking) or bool(enable)

    def _no_reasoning(self) -> bool:
        return not self.thinking
