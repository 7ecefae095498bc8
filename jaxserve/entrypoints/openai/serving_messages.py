"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (vLLM's
`entrypoints/anthropic`) over the chat path.

A request becomes a chat request (`protocol_anthropic.to_chat_request`) that
`OpenAIServingChat` prepares exactly as /v1/chat/completions would (template, tools, images,
checks); its one choice is parsed by the same `ChoiceParser` into reasoning (`thinking`
blocks), text and tool calls (`tool_use` blocks), whole or as Anthropic's server-sent events:
message_start, ping, per block content_block_start / _delta (text_delta, thinking_delta,
input_json_delta) / _stop, then message_delta (stop_reason, usage) and message_stop. With
--enable-prompt-tokens-details the final usage splits the prompt as Anthropic does: tokens read
from the prefix cache, tokens written to it, the rest (vLLM's). Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}` (an `error` event once a stream has started).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.entrypoints.openai.api_common import (
    MsgspecJSONResponse,
    decode_body,
    generate_route,
    logger,
    off_loop,
    serving_of,
)
from jaxserve.entrypoints.openai.cache_usage import cache_write_tokens
from jaxserve.entrypoints.openai.protocol import ChatMessage
from jaxserve.entrypoints.openai.protocol_anthropic import (
    ERROR_TYPES,
    AnthropicError,
    AnthropicErrorInfo,
    CountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    Usage,
    message_id,
    stop_reason,
    to_chat_request,
    tool_input,
    tool_use_id,
    usage,
)
from jaxserve.entrypoints.openai.request_body import RequestTooLarge
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_engine import error_status

_json = msgspec.json.Encoder()


def error_json(status: int, message: str) -> AnthropicError:
    return AnthropicError(error=AnthropicErrorInfo(ERROR_TYPES.get(status, "api_error"), message))


def status_of(e: BaseException) -> int:
    """An exception's HTTP status, as the OpenAI routes answer it, but for a dead engine:
    Anthropic's 500 api_error (its API has no 503)."""
    if isinstance(e, RequestTooLarge):
        return 413
    if isinstance(e, EngineDeadError):
        return 500
    return error_status(e)[0]


def anthropic_error_response(e: BaseException) -> Response:
    status = status_of(e)
    if status == 500 and not isinstance(e, EngineDeadError):
        logger.exception("internal error", exc_info=e)
    return MsgspecJSONResponse(error_json(status, str(e)), status_code=status)


def event(name: str, payload: Any) -> bytes:
    """One server-sent event with its name (the anthropic client skips unnamed ones)."""
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


class ServingMessages:
    """The Messages API over the app's chat serving (its engine, template and parsers)."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    # ------------------------------------------------------------------ preparing
    def prepare_messages(self, body: MessagesRequest):
        """(the chat request, OpenAIServingChat.prepare_chat's result) for `body`."""
        chat_request = to_chat_request(body)
        return chat_request, self.chat.prepare_chat(chat_request)

    async def load_images(self, prepared):
        chat_request, chat_prepared = prepared
        return chat_request, await self.chat.load_images(chat_prepared)

    def count_input_tokens(self, body: CountTokensRequest) -> dict[str, Any]:
        """The rendered prompt's token count (the model checked, as for a message), and
        vLLM's context_management (nothing is trimmed: the same count)."""
        self.chat.check_runner("Messages")
        self.chat.check_model(body.model)
        _, ids = self.chat.chat_prompt(to_chat_request(body))
        return {"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}}

    def _usage(self, prompt_tokens: int, output_tokens: int, cached: int) -> Usage:
        """With --enable-prompt-tokens-details, the prefix cache's part of the prompt too."""
        if not self.chat.enable_prompt_tokens_details:
            return usage(prompt_tokens, output_tokens, None)
        written = cache_write_tokens(self.chat.engine.config.cache, prompt_tokens, cached)
        return usage(prompt_tokens, output_tokens, (cached, written))

    # ------------------------------------------------------------------ running
    async def messages(self, body: MessagesRequest, prepared) -> MessagesResponse:
        chat_request, (request_id, prompts, params) = prepared
        (out,) = await self.chat._gather(
            request_id, prompts, params, 0, chat_request.kv_transfer_params
        )
        c = out.outputs[0]
        message, _ = self.chat._choice_parser(chat_request).full(c.text)
        content: list[dict[str, Any]] = []
        if message.reasoning:
            content.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(),
                    "name": call.function.name,
                    "input": tool_input(call.function.arguments),
                }
            )
        if not content:  # Anthropic's empty answer: one empty text block, never none
            content.append({"type": "text", "text": ""})
        reason = stop_reason(c.finish_reason, c.stop_reason, bool(message.tool_calls))
        matched = c.stop_reason if reason == "stop_sequence" else None
        response = MessagesResponse(
            id=message_id(),
            model=self.chat._name(body.model),
            content=content,
            stop_reason=reason,
            stop_sequence=matched,
            usage=self._usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens),
        )
        if out.kv_transfer_params is not None:
            response.kv_transfer_params = out.kv_transfer_params
        return response

    async def messages_stream(self, body: MessagesRequest, prepared) -> AsyncIterator[bytes]:
        chat_request, (request_id, prompts, params) = prepared
        input_tokens, output_tokens, cached = len(prompts[0]["prompt_token_ids"]), 0, 0
        parser = self.chat._choice_parser(chat_request)
        blocks = _Blocks()
        message = MessagesResponse(
            id=message_id(),
            model=self.chat._name(body.model),
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=Usage(input_tokens, 0),
        )
        yield event("message_start", {"type": "message_start", "message": message})
        yield event("ping", {"type": "ping"})
        try:
            async for _, out in self.chat._merged(
                request_id, prompts, params, 0, chat_request.kv_transfer_params
            ):
                input_tokens = len(out.prompt_token_ids or ()) or input_tokens  # images expanded
                cached = out.num_cached_tokens
                c = out.outputs[0]
                output_tokens += len(c.token_ids)
                for piece in blocks.delta(parser.delta(c.text, c.token_ids) if c.text else None):
                    yield piece
                if c.finish_reason is None:
                    continue
                for piece in blocks.delta(parser.finish()) + blocks.stop():
                    yield piece
                reason = stop_reason(c.finish_reason, c.stop_reason, blocks.tool_use)
                matched = c.stop_reason if reason == "stop_sequence" else None
                delta = {"stop_reason": reason, "stop_sequence": matched}
                final = self._usage(input_tokens, output_tokens, cached)
                yield event(
                    "message_delta", {"type": "message_delta", "delta": delta, "usage": final}
                )
            yield event("message_stop", {"type": "message_stop"})
        except Exception as e:
            status = status_of(e)
            if status == 500 and not isinstance(e, EngineDeadError):
                logger.exception("internal error", exc_info=e)
            yield event("error", error_json(status, str(e)))


class _Blocks:
    """A choice's streamed deltas as content block events: a block opens when the kind of
    what comes changes (thinking, text, or a new tool call) and the open one closes."""

    def __init__(self):
        self.index = -1
        self.open: Any = None  # "thinking", "text", ("tool_use", call index) or None
        self.tool_use = False

    def delta(self, d: ChatMessage | None) -> list[bytes]:
        if d is None:
            return []
        events: list[bytes] = []
        if d.reasoning:
            if self.open != "thinking":
                events += self._start(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            events.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        for call in d.tool_calls:
            fn = call.function
            if fn is not None and fn.name is not None:  # a new call
                self.tool_use = True
                block = {"type": "tool_use", "id": tool_use_id(), "name": fn.name, "input": {}}
                events += self._start(("tool_use", call.index), block)
            if fn is not None and fn.arguments and self.open == ("tool_use", call.index):
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": fn.arguments})
                )
        return events

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, kind: Any, block: dict[str, Any]) -> list[bytes]:
        events = self.stop()
        self.index += 1
        self.open = kind
        payload = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, event("content_block_start", payload)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return event("content_block_delta", payload)


# ---------------------------------------------------------------------- routes
async def create_message(request: Request) -> Response:
    """POST /v1/messages"""
    s: ServingMessages = request.app.state.serving_messages
    return await generate_route(
        request,
        MessagesRequest,
        s.prepare_messages,
        s.messages,
        s.messages_stream,
        s.load_images,
        errors=anthropic_error_response,
    )


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens"""
    s: ServingMessages = request.app.state.serving_messages
    try:
        engine = serving_of(request).engine
        if engine.errored:
            raise engine.dead or engine.engine_core.poll_dead()
        body = await decode_body(request, CountTokensRequest)
        result = await off_loop(request, s.count_input_tokens, body)
    except Exception as e:
        return anthropic_error_response(e)
    return MsgspecJSONResponse(result)
