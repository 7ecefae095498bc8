"""MiniMax-M2's thinking, as vLLM's two parsers read it. Its chat template opens the
assistant turn with `<think>\\n`, so the output starts inside the reasoning:

  minimax_m2               reasoning up to the first `</think>`, content after it (as
                           deepseek_r1 reads R1: all reasoning while `</think>` is missing)
  minimax_m2_append_think  no split: the whole output is content, `<think>` put back in
                           front of it (for clients that keep the thinking in the text, as
                           MiniMax recommends for multi-turn tool use)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.chat_messages import DeltaMessage
from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParserManager
from jaxserve.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser


@ReasoningParserManager.register_module("minimax_m2")
class MiniMaxM2ReasoningParser(DeepSeekR1ReasoningParser):
    """Reasoning implied from the first token, up to `</think>`."""


@ReasoningParserManager.register_module("minimax_m2_append_think")
class MiniMaxM2AppendThinkReasoningParser(DeepSeekR1ReasoningParser):
    """All content, starting with the `<think>` the prompt opened."""

    def _no_reasoning(self) -> bool:
        return True

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        return None, self.start_token + model_output

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        content = delta_text if previous_text else self.start_token + delta_text
        return DeltaMessage(content=content) if content else None

    def flush_streaming(self, text: str) -> DeltaMessage | None:
        return None
