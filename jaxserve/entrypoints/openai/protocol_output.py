"""What /v1/completions and /v1/chat/completions answer, key for key as vLLM sends it.

vLLM sends a whole response with every field of its model, null where there is nothing (an
openai-SDK client reads `choice.prompt_logprobs` or `response.prompt_token_ids` and gets None
instead of an AttributeError), and a streamed chunk with only the fields it set for that kind
of chunk. The whole-response structs here encode every field; the chunk structs leave out what
is UNSET. Fields vLLM has and jaxserve never fills (service_tier, system_fingerprint: jaxserve
sends none, ec_transfer_params, metrics, routed_experts) are always null.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from jaxserve.chat_messages import ChatMessage, ToolCall


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (or loaded from a peer)
    # vLLM's counts of cache-creating and multimodal tokens: jaxserve has neither (null in a
    # whole response, left out of a stream's usage chunk)
    created_cache_tokens: None | UnsetType = UNSET
    multimodal_tokens: None | UnsetType = UNSET


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Only with --enable-prompt-tokens-details (null in a whole response otherwise)
    prompt_tokens_details: PromptTokensDetails | None | UnsetType = UNSET
    completion_tokens_details: None | UnsetType = UNSET  # vLLM's reasoning-token count

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, **details) -> UsageInfo:
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, **details)

    def whole(self) -> UsageInfo:
        """This usage as a whole response carries it: every field, null where unknown."""
        details = self.prompt_tokens_details
        if isinstance(details, PromptTokensDetails):
            details = msgspec.structs.replace(
                details, created_cache_tokens=None, multimodal_tokens=None
            )
        return msgspec.structs.replace(
            self, prompt_tokens_details=details or None, completion_tokens_details=None
        )


# ---------------------------------------------------------------- /v1/completions
class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # [None, {token id: ...}, ...]
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    routed_experts: None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    object: str = "text_completion"
    service_tier: None = None
    system_fingerprint: None = None
    # What the engine's KV connector set (a prefill instance's, for the decoder)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: None = None
    metrics: None = None

    def __post_init__(self) -> None:
        self.usage = self.usage.whole()


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # a choice's first chunk, with return_token_ids
    token_ids: list[int] | None = None  # this chunk's, with return_token_ids


class CompletionChunk(msgspec.Struct):
    """A streamed chunk; the usage chunk at the end has no choices."""

    id: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | UnsetType = UNSET  # continuous usage stats, and the usage chunk
    object: str = "text_completion"


# ---------------------------------------------------------------- /v1/chat/completions
class ResponseMessage(msgspec.Struct):
    """A whole response's message (vLLM's ChatMessage): tool_calls only when there are some;
    reasoning_content (the older name) beside reasoning only when there is reasoning."""

    role: str | None
    content: str | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning: str | None = None
    reasoning_content: str | UnsetType = UNSET

    @classmethod
    def of(cls, m: ChatMessage) -> ResponseMessage:
        reasoning = m.reasoning or m.reasoning_content
        return cls(
            m.role,
            m.content,
            tool_calls=list(m.tool_calls) or UNSET,
            reasoning=reasoning,
            reasoning_content=UNSET if reasoning is None else reasoning,
        )


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage  # a ChatMessage given here becomes one
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    routed_experts: None = None

    def __post_init__(self) -> None:
        if isinstance(self.message, ChatMessage):
            self.message = ResponseMessage.of(self.message)


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    service_tier: None = None
    system_fingerprint: None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_text: str | None = None  # the templated prompt, with return_prompt_text
    kv_transfer_params: dict[str, Any] | None = None  # as CompletionResponse's
    ec_transfer_params: None = None
    metrics: None = None

    def __post_init__(self) -> None:
        self.usage = self.usage.whole()


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    # vLLM's chunks: stop_reason only on the finishing one, token_ids on each after the role's
    stop_reason: int | str | None | UnsetType = UNSET
    token_ids: list[int] | None | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.finish_reason is None:
            self.stop_reason = UNSET


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None | UnsetType = UNSET  # None: left out, as UNSET
    object: str = "chat.completion.chunk"
    # The role chunks only (null unless return_token_ids / return_prompt_text asked for them)
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    prompt_text: str | None | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.usage is None:
            self.usage = UNSET
