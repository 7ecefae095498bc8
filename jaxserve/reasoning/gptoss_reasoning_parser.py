"""gpt-oss (`openai_gptoss`): the harmony analysis channel is the reasoning (reasoning.harmony).

The reasoning is the analysis messages' bodies, joined by newlines. The content is the rest,
in order: the bodies of the final messages and of commentary preambles (commentary without a
recipient), joined by newlines, and each tool call (a message to `functions.NAME`) kept as
harmony text, `<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGS`,
for the `openai` tool parser to read; without one it stays in the content as the model wrote
it. Streaming sends each piece once its header is complete, then its body as it grows.
Plain text without harmony tokens is all content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.chat_messages import DeltaMessage
from jaxserve.reasoning import harmony
from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


def call_text(message: harmony.Message) -> str:
    """A tool-call message as harmony text (the form the `openai` tool parser reads)."""
    text = (
        f"{harmony.START}assistant to={message.recipient}{harmony.CHANNEL}"
        f"{message.channel or 'commentary'}{harmony.MESSAGE}{message.body}"
    )
    return text + harmony.CALL if message.done else text


def split(text: str) -> tuple[str, str]:
    """(reasoning, content) of a completion's text so far (see the module docstring)."""
    reasoning, rest = harmony.sections(text)
    return "\n".join(reasoning), harmony.join_bodies(rest, call_text)


@ReasoningParserManager.register_module(["openai_gptoss", "gpt_oss"])
class GptOssReasoningParser(ReasoningParser):
    start_token = harmony.CHANNEL + "analysis" + harmony.MESSAGE
    end_token = harmony.CHANNEL + "final" + harmony.MESSAGE

    def __init__(self, tokenizer: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self._sent = ("", "")

    def adjust_request(self, request: Any) -> Any:
        """Harmony's structure is special tokens: keep them in the text, unspaced."""
        request.skip_special_tokens = False
        request.spaces_between_special_tokens = False
        return request

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        reasoning, content = split(model_output)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int] = (),
        current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
    ) -> DeltaMessage | None:
        return self._advance(split(current_text))

    def flush_streaming(self, text: str) -> DeltaMessage | None:
        return self._advance(split(text))

    def _advance(self, now: tuple[str, str]) -> DeltaMessage | None:
        """What `now` adds to what was sent (each part of a prefix grows only at its end)."""
        (sent_r, sent_c), (r, c) = self._sent, now
        self._sent = now
        reasoning, content = r[len(sent_r) :], c[len(sent_c) :]
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)

    def is_reasoning_end_text(self, text: str) -> bool:
        """Whether a final message (or a tool call) has begun: the answer is being written."""
        return any(
            m.header_done and (m.channel == "final" or m.tool_name is not None)
            for m in harmony.parse(text)
        )

    _ended = is_reasoning_end_text  # extract_content_ids: the ids after the final's header
