"""/v1/responses (OpenAI's Responses API, vLLM's `serving_responses.py`) over the chat path:
a request becomes a ChatCompletionRequest (protocol_responses.py: items -> messages, flat
tools -> chat's, text.format -> response_format), prepared, rendered and run by
OpenAIServingChat, parsed by its ChoiceParser (reasoning, content, tool calls); the result
comes back as output items, whole or as the Responses event stream (responses_events.py:
`event:` + `data:`, every event with a rising sequence_number, response.completed last,
whatever the status).

With JAXSERVE_ENABLE_RESPONSES_API_STORE, responses asked to be stored (`store`, true by
default) are kept in memory (responses_store.py): GET /v1/responses/{id} returns one, and
`previous_response_id` continues its conversation (its input and output before the new input;
its instructions are not carried over, as OpenAI's). Without it, `store` is accepted and
echoed false, and previous_response_id and GET are 400s naming the variable (vLLM's default
too)."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jaxserve import envs
from jaxserve.entrypoints.openai.api_common import (
    MsgspecJSONResponse,
    error_response,
    generate_route,
)
from jaxserve.entrypoints.openai.cache_usage import cache_write_tokens
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ErrorInfo,
    ErrorResponse,
)
from jaxserve.entrypoints.openai.protocol_responses import (
    CHAT_FIELDS,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    RawMessage,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    TextConfig,
    chat_tool_choice,
    chat_tools,
    echo_tool_choice,
    echo_tools,
    input_items,
    item_id,
    now,
    response_format,
    template_kwargs,
    to_messages,
)
from jaxserve.entrypoints.openai.responses_events import ResponseEvents, output_items
from jaxserve.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_engine import error_status
from jaxserve.sampling_params import SamplingParams

STORE_OFF = (
    "the response store is off: set JAXSERVE_ENABLE_RESPONSES_API_STORE=1 (vLLM's "
    "VLLM_ENABLE_RESPONSES_API_STORE) on the server to use {}"
)


class ResponseNotFound(LookupError):
    """A 404: no stored response has this id."""


class _Context(msgspec.Struct):
    request: ResponsesRequest
    id: str
    created_at: int
    history: list  # the conversation's items up to and including this request's input
    store: bool  # this response is kept
    params: SamplingParams  # as the engine runs them (the response echoes them)
    max_tokens: int  # the most output tokens: asked for, or the room the context leaves


class _Run(msgspec.Struct):
    """What one run gave: token counts (cached: read from the prefix cache), and the raw
    prompt and output enable_response_messages shows."""

    prompt: str
    prompt_ids: list[int]
    text: str = ""
    ids: list[int] = msgspec.field(default_factory=list)
    cached: int = 0
    kv_transfer_params: dict | None = None
    reasoning: int = 0  # output tokens of reasoning


def reasoning_tokens(reasoner, ids: list[int]) -> int:
    """The output's reasoning tokens: those before the end of its thinking, the start and end
    markers aside (vLLM's count_reasoning_tokens); 0 without a reasoning parser."""
    if reasoner is None or not ids:
        return 0
    head = ids[: len(ids) - len(reasoner.extract_content_ids(ids))]
    markers = (reasoner.start_token_id, reasoner.end_token_id)
    return sum(1 for token in head if token not in markers)


class OpenAIServingResponses:
    """The chat API's serving (template, parsers, engine) and the response store (None
    unless JAXSERVE_ENABLE_RESPONSES_API_STORE)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore | None = None):
        self.chat = chat
        self.store = store
        if store is None and envs.JAXSERVE_ENABLE_RESPONSES_API_STORE:
            self.store = ResponsesStore()

    # ------------------------------------------------------------------ preparing
    def prepare(self, request: ResponsesRequest):
        """(context, the chat request, prepare_chat's result); ValueError (a 400) naming a bad
        field, ResponseNotFound (a 404) for an unknown previous_response_id."""
        self.chat.check_runner("Responses")
        if request.background:
            raise ValueError("background is not supported: leave it false")
        if request.truncation not in (None, "disabled"):
            raise ValueError(f'truncation must be "disabled", got {request.truncation!r:.100}')
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise ValueError(
                f"max_output_tokens must be at least 1, got {request.max_output_tokens}"
            )
        history: list = []
        if request.previous_response_id is not None:
            history = self._history(request.previous_response_id)
        items = input_items(request)
        messages = to_messages(history, "previous_response") + to_messages(items)
        if request.instructions is not None:
            messages.insert(0, {"role": "system", "content": request.instructions})
        tools = chat_tools(request.tools)
        logprobs = "message.output_text.logprobs" in (request.include or ())
        chat = ChatCompletionRequest(
            messages=messages,
            max_completion_tokens=request.max_output_tokens,
            tools=tools,
            logprobs=logprobs,
            top_logprobs=request.top_logprobs if logprobs else None,
            tool_choice=chat_tool_choice(request.tool_choice, tools),
            response_format=response_format(request.text),
            chat_template_kwargs=template_kwargs(request),
            **{field: getattr(request, field) for field in CHAT_FIELDS},
        )
        prepared = self.chat.prepare_chat(chat)
        store = self.store is not None and request.store
        _, prompts, params = prepared
        room = self.chat.max_model_len - len(prompts[0]["prompt_token_ids"])
        context = _Context(
            request,
            item_id("resp"),
            now(),
            history + items,
            store,
            params,
            params.max_tokens or room,
        )
        return context, chat, prepared

    def _history(self, response_id: str) -> list:
        if self.store is None:
            raise ValueError(STORE_OFF.format("previous_response_id"))
        stored = self.store.get(response_id)
        if stored is None:
            raise ResponseNotFound(f"Response with id {response_id!r} not found.")
        return stored.history + msgspec.to_builtins(stored.response.output)

    async def load_images(self, prepared):
        """The chat request's image parts (input_image), fetched as chat's are."""
        context, chat, inner = prepared
        return context, chat, await self.chat.load_images(inner)

    # ------------------------------------------------------------------ answering
    async def respond(self, request: ResponsesRequest, prepared) -> ResponsesResponse:
        context, chat_request, (request_id, prompts, params) = prepared
        (out,) = await self.chat._gather(
            request_id, prompts, params, chat_request.priority, chat_request.kv_transfer_params
        )
        (c,) = out.outputs
        parser = self.chat._choice_parser(chat_request)
        message, _ = parser.full(c.text)
        if not chat_request.include_reasoning:
            message.reasoning = None
        incomplete = c.finish_reason == "length"
        items = output_items(message, self._logprobs(c, chat_request))
        if incomplete and items:
            items[-1].status = "incomplete"
        run = _Run(
            prompts[0]["prompt"],
            list(out.prompt_token_ids),
            c.text,
            list(c.token_ids),
            out.num_cached_tokens,
            out.kv_transfer_params,
        )
        run.reasoning = reasoning_tokens(parser.reasoner, run.ids)
        return self._finish(context, items, incomplete, run)

    async def respond_stream(self, request: ResponsesRequest, prepared):
        """The Responses events (bytes), response.completed (with the whole response) last;
        a failure: an `error` event, last."""
        context, chat_request, (request_id, prompts, params) = prepared
        events = ResponseEvents()
        start = self._response(context, [], "in_progress")
        yield events.event("response.created", response=start)
        yield events.event("response.in_progress", response=start)
        parser = self.chat._choice_parser(chat_request)
        run = _Run(prompts[0]["prompt"], prompts[0]["prompt_token_ids"])
        finish_reason = None
        try:
            async for _, out in self.chat._merged(
                request_id, prompts, params, chat_request.priority, chat_request.kv_transfer_params
            ):
                run.cached = out.num_cached_tokens
                run.prompt_ids = out.prompt_token_ids or run.prompt_ids  # images expanded
                run.kv_transfer_params = out.kv_transfer_params or run.kv_transfer_params
                (c,) = out.outputs
                run.text += c.text
                run.ids += c.token_ids
                logprobs = self._logprobs(c, chat_request)  # the text's, with its deltas
                deltas = [(parser.delta(c.text, c.token_ids) if c.text else None, logprobs)]
                if c.finish_reason is not None:
                    deltas.append((parser.finish(), []))
                for delta, lp in deltas:
                    if delta is not None and not chat_request.include_reasoning:
                        delta.reasoning = None  # generated, not sent (vLLM's include_reasoning)
                    for event in events.delta(delta, lp):
                        yield event
                finish_reason = c.finish_reason or finish_reason
            incomplete = finish_reason == "length"
            run.reasoning = reasoning_tokens(parser.reasoner, run.ids)
            for event in events.close("incomplete" if incomplete else "completed"):
                yield event
            response = self._finish(context, events.items, incomplete, run)
        except Exception as e:
            _, kind = error_status(e)
            yield events.event("error", code=kind, message=str(e), param=None)
            return
        yield events.event("response.completed", response=response)

    def _logprobs(self, c, chat_request: ChatCompletionRequest) -> list:
        """include ["message.output_text.logprobs"]: the output's tokens' logprobs as chat's
        (the shape of OpenAI's Logprob) for its output_text."""
        logprobs = self.chat._chat_logprobs(c, chat_request)
        return logprobs["content"] if logprobs else []

    def _finish(self, context: _Context, items, incomplete: bool, run: _Run) -> ResponsesResponse:
        """The finished response (kept, when stored)."""
        response = self._response(context, items, "incomplete" if incomplete else "completed")
        prompt_tokens, output_tokens = len(run.prompt_ids), len(run.ids)
        written = cache_write_tokens(self.chat.engine.config.cache, prompt_tokens, run.cached)
        response.usage = ResponseUsage(
            prompt_tokens,
            output_tokens,
            prompt_tokens + output_tokens,
            InputTokensDetails(run.cached, written),
            OutputTokensDetails(run.reasoning),
        )
        if incomplete:
            response.incomplete_details = IncompleteDetails("max_output_tokens")
        response.kv_transfer_params = run.kv_transfer_params
        if context.request.enable_response_messages:
            response.input_messages = [RawMessage(run.prompt, run.prompt_ids)]
            response.output_messages = [RawMessage(run.text, run.ids)] if run.ids else []
        if context.store:
            self.store.put(context.id, StoredResponse(response, context.history))
        return response

    def _response(self, context: _Context, items: list, status: str) -> ResponsesResponse:
        r, p = context.request, context.params
        return ResponsesResponse(
            id=context.id,
            created_at=context.created_at,
            model=self.chat._name(r.model),
            output=list(items),
            status=status,
            instructions=r.instructions,
            max_output_tokens=context.max_tokens,
            max_tool_calls=r.max_tool_calls,
            temperature=p.temperature,
            top_p=p.top_p,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            top_logprobs=p.logprobs,
            tools=echo_tools(r.tools),
            tool_choice=echo_tool_choice(r.tool_choice, r.tools),
            parallel_tool_calls=r.parallel_tool_calls,
            text=r.text or TextConfig(),
            reasoning=r.reasoning,
            previous_response_id=r.previous_response_id,
            store=context.store,
            user=r.user,
            metadata=r.metadata,
            service_tier=r.service_tier or "auto",
        )

    @staticmethod
    async def create_route(request: Request) -> Response:
        """POST /v1/responses."""
        s = request.app.state.serving_responses
        return await generate_route(
            request,
            ResponsesRequest,
            s.prepare,
            s.respond,
            s.respond_stream,
            s.load_images,
            errors=_errors,
        )

    @staticmethod
    async def get_route(request: Request) -> Response:
        """GET /v1/responses/{response_id}: a stored response."""
        try:
            s = request.app.state.serving_responses
            return MsgspecJSONResponse(s.retrieve(request.path_params["response_id"]))
        except Exception as e:
            return _errors(e)

    def retrieve(self, response_id: str) -> ResponsesResponse:
        if self.store is None:
            raise ValueError(STORE_OFF.format("GET /v1/responses/{id}"))
        stored = self.store.get(response_id)
        if stored is None:
            raise ResponseNotFound(f"Response with id {response_id!r} not found.")
        return stored.response


def _errors(e: BaseException) -> Response:
    if isinstance(e, ResponseNotFound):
        info = ErrorInfo(str(e), "NotFoundError", 404)
        return MsgspecJSONResponse(ErrorResponse(info), status_code=404)
    return error_response(e)
