"""/v1/completions and /v1/chat/completions over AsyncLLM (vLLM's OpenAI server behaviour).

Each handler validates everything first (body types, model name, unsupported fields, sampling
parameters, every prompt through the InputProcessor), so a bad request fails alone with a 400
before anything reaches the engine; then it runs one AsyncLLM.generate per prompt and either
gathers the final outputs or streams DELTA outputs as server-sent events. Cancelling the
handler (the client went away) closes the generators, which aborts the requests in the core.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.chat_utils import (
    CONTENT_FORMATS,
    ChoiceParser,
    check_tools,
    content_format,
    template_messages,
    tool_choice,
    tool_choice_constraint,
)
from jaxserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
    check_supported,
    random_id,
    to_sampling_params,
)
from jaxserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams, generation_defaults

_json = msgspec.json.Encoder()
# The engine a request runs on, from its X-data-parallel-rank header (vLLM's); None: any.
DATA_PARALLEL_RANK: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "data_parallel_rank", default=None
)


class ModelNotFound(LookupError):
    pass


def sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        enable_prompt_tokens_details: bool = False,
    ):
        self.engine = engine
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.model_names = served_model_names
        self.chat_template = chat_template
        self.tokenizer = engine.get_tokenizer()
        self.content_format = chat_template_content_format
        if self.content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                f"got {self.content_format!r}"
            )
        self.tool_parser_cls = None
        if tool_parser is not None:
            from jaxserve.entrypoints.openai.tool_parsers import ToolParserManager

            self.tool_parser_cls = ToolParserManager.get_tool_parser(tool_parser)
        self.auto_tools = enable_auto_tools and self.tool_parser_cls is not None
        self.reasoning_parser_cls = None
        if reasoning_parser is not None:
            from jaxserve.reasoning import ReasoningParserManager

            self.reasoning_parser_cls = ReasoningParserManager.get_reasoning_parser(
                reasoning_parser
            )
        self.defaults = generation_defaults(engine.generation_config)
        self.max_model_len = engine.config.scheduler.max_model_len

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ModelNotFound(f"The model `{model}` does not exist.")

    # ------------------------------------------------------------------ prompts
    def completion_prompts(
        self, prompt: str | list[Any], field: str = "prompt"
    ) -> list[tuple[str | None, list[int]]]:
        """str | list[str] | list[int] | list[list[int]] -> [(text or None, token ids)]."""
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            prompts = prompt
        if not prompts:
            raise ValueError(f"{field} must not be empty")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.engine.input_processor.tokenize(p))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError(
                    f"{field} must be a string, a list of strings, a list of token ids or a "
                    f"list of lists of token ids, got {type(p).__name__} inside the list"
                )
        return out

    def chat_prompt(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if not request.messages:
            raise ValueError("messages must not be empty")
        template = request.chat_template or self.chat_template
        fmt = content_format(template or self.tokenizer.chat_template, self.content_format)
        messages = template_messages(request.messages, fmt)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=request.tools,
                chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as e:  # a malformed conversation or template
            raise ValueError(f"cannot apply the chat template: {e}") from None
        self.engine.input_processor.check_text_length(text)
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    def _validate(self, request_id: str, prompts, params: SamplingParams) -> list[dict]:
        """Every prompt through the InputProcessor's checks before anything is queued."""
        for i, (_, ids) in enumerate(prompts):
            self.engine.input_processor.process(f"{request_id}-{i}", ids, params)
        return [{"prompt": text, "prompt_token_ids": ids} for text, ids in prompts]

    # ------------------------------------------------------------------ completions
    def check_runner(self, api: str) -> None:
        """One server runs one kind of model (vLLM): generation or pooling."""
        pooling = self.engine.config.pooler is not None
        if pooling != (api == "Embeddings"):
            hint = "--runner pooling" if api == "Embeddings" else "without --runner pooling"
            raise ValueError(f"The model does not support the {api} API (serve it {hint})")

    def prepare_embedding(self, request: EmbeddingRequest):
        self.check_model(request.model)
        self.check_runner("Embeddings")
        if request.encoding_format not in ("float", "base64"):
            raise ValueError(
                f"encoding_format {request.encoding_format!r} is not one of float, base64"
            )
        pooling = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        pooling.verify(self.engine.config.model.hidden_size)
        prompts = self.completion_prompts(request.input, "input")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        request_id = random_id("embd")
        return request_id, self._validate(request_id, prompts, params), params, pooling

    async def embedding(self, request: EmbeddingRequest, prepared) -> EmbeddingResponse:
        request_id, prompts, params, pooling = prepared
        finals = await self._gather(request_id, prompts, params, request.priority)
        default_normalize = self.engine.config.pooler.normalize
        data = []
        for i, out in enumerate(finals):
            vector = pooling.apply(out.pooled, default_normalize)
            if request.encoding_format == "base64":
                vector = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
            data.append(EmbeddingData(i, vector))
        usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in finals), 0)
        return EmbeddingResponse(
            request_id, int(time.time()), self._name(request.model), data, usage
        )

    def prepare_completion(self, request: CompletionRequest):
        self.check_model(request.model)
        self.check_runner("Completions")
        check_supported(request)
        prompts = self.completion_prompts(request.prompt)
        params = to_sampling_params(
            request, self.defaults, max_tokens=request.max_tokens, logprobs=request.logprobs
        )
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params = msgspec.structs.replace(params, prompt_logprobs=request.logprobs)
        request_id = random_id("cmpl")
        return request_id, self._validate(request_id, prompts, params), params

    async def completion(self, request: CompletionRequest, prepared) -> CompletionResponse:
        request_id, prompts, params = prepared
        finals = await self._gather(
            request_id, prompts, params, request.priority, request.kv_transfer_params
        )
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text, logprobs = c.text, None
                if request.echo:
                    text = self._prompt_text(out) + text
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(out, c, request.echo, request.logprobs)
                choice = CompletionChoice(
                    p * params.n + c.index, text, logprobs, c.finish_reason, c.stop_reason
                )
                if request.prompt_logprobs is not None:
                    choice.prompt_logprobs = _prompt_logprobs(out)
                choices.append(choice)
        cached = sum(out.num_cached_tokens for out in finals)
        usage = self._usage(prompt_tokens, completion_tokens, cached)
        response = CompletionResponse(
            request_id, int(time.time()), self._name(request.model), choices, usage
        )
        if finals[0].kv_transfer_params is not None:
            response.kv_transfer_params = finals[0].kv_transfer_params
        return response

    async def completion_stream(self, request: CompletionRequest, prepared) -> AsyncIterator[bytes]:
        request_id, prompts, params = prepared
        created, model = int(time.time()), self._name(request.model)
        include_usage, continuous = _usage_options(request)
        prompt_tokens, completion_tokens = 0, 0
        echoed, cached = set(), {}
        try:
            async for p, out in self._merged(
                request_id, prompts, params, request.priority, request.kv_transfer_params
            ):
                cached[p] = out.num_cached_tokens
                if p not in echoed:
                    echoed.add(p)
                    prompt_tokens += len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    text = c.text
                    if request.echo and (p, c.index) not in echoed:
                        echoed.add((p, c.index))
                        text = self._prompt_text(out) + text
                    if not text and c.finish_reason is None and not c.token_ids:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._completion_logprobs(out, c, False, request.logprobs)
                    choice = CompletionChoice(
                        p * params.n + c.index, text, logprobs, c.finish_reason, c.stop_reason
                    )
                    usage = UsageInfo.of(prompt_tokens, completion_tokens) if continuous else None
                    yield sse(CompletionResponse(request_id, created, model, [choice], usage))
            if include_usage:
                usage = self._usage(prompt_tokens, completion_tokens, sum(cached.values()))
                yield sse(CompletionResponse(request_id, created, model, [], usage))
        except Exception as e:
            yield sse(error_body(e))
        yield SSE_DONE

    # ------------------------------------------------------------------ chat
    def prepare_chat(self, request: ChatCompletionRequest):
        self.check_runner("Chat Completions")
        self.check_model(request.model)
        check_supported(request)
        check_tools(request, auto_tools=self.auto_tools)
        if request.top_logprobs is not None and not request.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.tool_parser_cls is not None and request.tools:
            request = self.tool_parser_cls(self.tokenizer).adjust_request(request)
        prompt = self.chat_prompt(request)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_tokens
        if request.max_completion_tokens is not None:
            if request.max_completion_tokens < 1:
                raise ValueError(
                    f"max_completion_tokens must be at least 1, got {request.max_completion_tokens}"
                )
            max_tokens = request.max_completion_tokens
        params = to_sampling_params(
            request, self.defaults, max_tokens=max_tokens, logprobs=logprobs
        )
        constraint = tool_choice_constraint(request)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise ValueError(
                    f"tool_choice {tool_choice(request)!r:.100} cannot be combined with "
                    "another output constraint (response_format, structured_outputs)"
                )
            params = msgspec.structs.replace(params, structured_outputs=constraint)
        request_id = random_id("chatcmpl")
        return request_id, self._validate(request_id, [prompt], params), params

    async def chat(self, request: ChatCompletionRequest, prepared) -> ChatCompletionResponse:
        request_id, prompts, params = prepared
        (out,) = await self._gather(
            request_id, prompts, params, request.priority, request.kv_transfer_params
        )
        choices = []
        for c in out.outputs:
            logprobs = self._chat_logprobs(c, request)
            message, called = self._choice_parser(request).full(c.text)
            if not request.include_reasoning:
                message.reasoning = message.reasoning_content = None
            finish_reason = (
                "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
            )
            choices.append(ChatChoice(c.index, message, logprobs, finish_reason, c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = self._usage(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens)
        response = ChatCompletionResponse(
            request_id, int(time.time()), self._name(request.model), choices, usage
        )
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = _prompt_logprobs(out)
        if out.kv_transfer_params is not None:
            response.kv_transfer_params = out.kv_transfer_params
        return response

    async def chat_stream(self, request: ChatCompletionRequest, prepared) -> AsyncIterator[bytes]:
        request_id, prompts, params = prepared
        created, model = int(time.time()), self._name(request.model)
        include_usage, continuous = _usage_options(request)
        prompt_tokens, completion_tokens = len(prompts[0]["prompt_token_ids"]), 0
        cached = 0

        def chunk(choices, usage=None):
            if usage is None and continuous:
                usage = UsageInfo.of(prompt_tokens, completion_tokens)
            return sse(ChatCompletionChunk(request_id, created, model, choices, usage))

        parsers = [self._choice_parser(request) for _ in range(params.n)]
        try:
            for i in range(params.n):  # the role first, once per choice
                yield chunk([ChatStreamChoice(i, ChatMessage("assistant", ""))])
            async for _, out in self._merged(
                request_id, prompts, params, request.priority, request.kv_transfer_params
            ):
                cached = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    parser = parsers[c.index]
                    delta = parser.delta(c.text, c.token_ids) if c.text else None
                    finish_reason = c.finish_reason
                    if finish_reason is not None:
                        delta = _joined(delta, parser.finish())
                        if parser.tools_called and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    if delta is not None and not request.include_reasoning:
                        delta.reasoning = delta.reasoning_content = None
                    # Held-back text still sends its tokens' logprobs, when asked for.
                    has_logprobs = bool(request.logprobs and c.token_ids)
                    if delta is None and finish_reason is None and not has_logprobs:
                        continue
                    logprobs = self._chat_logprobs(c, request)
                    delta = delta or ChatMessage(content="")
                    yield chunk(
                        [ChatStreamChoice(c.index, delta, logprobs, finish_reason, c.stop_reason)]
                    )
            if include_usage:
                yield chunk([], self._usage(prompt_tokens, completion_tokens, cached))
        except Exception as e:
            yield sse(error_body(e))
        yield SSE_DONE

    def _choice_parser(self, request: ChatCompletionRequest) -> ChoiceParser:
        return ChoiceParser(
            request, self.tool_parser_cls, self.reasoning_parser_cls, self.tokenizer
        )

    # ------------------------------------------------------------------ running
    async def _gather(
        self, request_id, prompts, params, priority, kv_transfer_params=None
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async for i, out in self._merged(request_id, prompts, params, priority, kv_transfer_params):
            finals[i] = out
        return finals

    async def _merged(self, request_id, prompts, params, priority, kv_transfer_params=None):
        """(prompt index, RequestOutput) from one generate per prompt, as they come. Leaving
        early (error, cancellation) closes every generator: unfinished requests are aborted.
        kv_transfer_params (the request's) go with every prompt, as in vLLM."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, prompt: dict) -> None:
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            try:
                async for out in self.engine.generate(
                    prompt, params, rid, priority=priority,
                    data_parallel_rank=DATA_PARALLEL_RANK.get(),
                    kv_transfer_params=kv_transfer_params,
                ):  # fmt: skip
                    await queue.put((i, out))
                await queue.put(done)
            except BaseException as e:  # noqa: BLE001 (handed to the consumer)
                await queue.put(e)
                if isinstance(e, asyncio.CancelledError):
                    raise

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ formatting
    def _name(self, requested: str | None) -> str:
        return requested or self.model_name

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """With --enable-prompt-tokens-details, prompt_tokens_details.cached_tokens too."""
        usage = UsageInfo.of(prompt_tokens, completion_tokens)
        if self.enable_prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens)
        return usage

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def _token_text(self, token_id: int, lp) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _completion_logprobs(
        self, out: RequestOutput, c: CompletionOutput, echo: bool, k: int
    ) -> dict:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
        ids: list[int] = []
        positions: list[PositionLogprobs | None] = []
        if echo:
            ids += out.prompt_token_ids
            positions += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        ids += c.token_ids
        positions += c.logprobs or []
        tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
        for token_id, position in zip(ids, positions, strict=True):
            text = self._token_text(token_id, position.get(token_id) if position else None)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if position is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(position[token_id].logprob)
            chosen = [(token_id, position[token_id])]  # always there, as in vLLM
            top.append(
                {self._token_text(t, lp): lp.logprob for t, lp in [*_top(position, k), *chosen]}
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, c: CompletionOutput, request: ChatCompletionRequest) -> dict | None:
        if not request.logprobs:
            return None
        k = request.top_logprobs or 0
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs or [], strict=True):
            chosen = position[token_id]
            text = self._token_text(token_id, chosen)
            content.append(
                {
                    "token": text,
                    "logprob": max(chosen.logprob, -9999.0),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t_text := self._token_text(t, lp)),
                            "logprob": max(lp.logprob, -9999.0),
                            "bytes": list(t_text.encode()),
                        }
                        for t, lp in _top(position, k)
                    ],
                }
            )
        return {"content": content}


def _joined(a: ChatMessage | None, b: ChatMessage | None) -> ChatMessage | None:
    """Two deltas of one choice as one (a's text first)."""
    if a is None or b is None:
        return a or b
    cat = lambda x, y: (x or "") + (y or "") or None  # noqa: E731
    reasoning = cat(a.reasoning, b.reasoning)
    return ChatMessage(
        content=cat(a.content, b.content),
        reasoning=reasoning,
        reasoning_content=reasoning,
        tool_calls=[*a.tool_calls, *b.tool_calls],
    )


def _usage_options(request) -> tuple[bool, bool]:
    """(usage chunk at the end, usage in every chunk) from stream_options."""
    options = request.stream_options
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats


def _prompt_logprobs(out: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs field: None for the first token, then {token id: {logprob,
    rank, decoded_token}} per prompt position."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {
                "logprob": max(lp.logprob, -9999.0),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in position.items()
        }
        for position in out.prompt_logprobs
    ]


def _top(position: PositionLogprobs, k: int) -> list:
    """The top-k (token id, Logprob) of a position, best first (the chosen token is in the
    dict too, with its own rank, which may be past k)."""
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank)


def error_body(e: BaseException) -> ErrorResponse:
    status, kind = error_status(e)
    return ErrorResponse(ErrorInfo(str(e), kind, status))


def error_status(e: BaseException) -> tuple[int, str]:
    from jaxserve.engine.core_client import EngineDeadError

    if isinstance(e, EngineDeadError):
        return 503, "ServiceUnavailableError"
    if isinstance(e, ModelNotFound):
        return 404, "NotFoundError"
    if isinstance(e, (ValueError, msgspec.ValidationError, msgspec.DecodeError)):
        return 400, "BadRequestError"
    return 500, "InternalServerError"
