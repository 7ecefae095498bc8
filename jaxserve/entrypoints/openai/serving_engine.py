"""What the OpenAI APIs share (vLLM's `serving_engine.py`): the `OpenAIServing` base class
over AsyncLLM, and the error mapping and server-sent events the HTTP layer uses.

Each API is a subclass in its own module: `serving_completion.py` (/v1/completions),
`serving_chat.py` (/v1/chat/completions), `serving_embedding.py` (/v1/embeddings);
`api_server.py` makes one of each and routes to them. Each handler validates everything first
(body types, model name, unsupported fields, sampling parameters, every prompt through the
InputProcessor), so a bad request fails alone with a 400 before anything reaches the engine;
then it runs one AsyncLLM.generate per prompt and either gathers the final outputs or streams
DELTA outputs as server-sent events. Cancelling the handler (the client went away) closes the
generators, which aborts the requests in the core.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import msgspec

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import EngineAsleepError, EngineDeadError
from jaxserve.entrypoints.openai.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    MAX_SEQUENCES_PER_REQUEST,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
)
from jaxserve.entrypoints.openai.serve_options import ServeOptions
from jaxserve.entrypoints.openai.serving_models import ModelNotFound, OpenAIServingModels
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import PositionLogprobs, RequestOutput
from jaxserve.sampling_params import SamplingParams

_json = msgspec.json.Encoder()
# The engine a request runs on, from its X-data-parallel-rank header (vLLM's); None: any.
DATA_PARALLEL_RANK: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "data_parallel_rank", default=None
)
# The request's W3C trace context (traceparent / tracestate headers, tracing.py): with
# --otlp-traces-endpoint its spans join the caller's trace (vLLM's trace_headers). None: none.
TRACE_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "trace_headers", default=None
)


def sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _is_token_id(value: Any) -> bool:
    """An int that is not a bool (JSON true is no token id)."""
    return isinstance(value, int) and not isinstance(value, bool)


class OpenAIServing:
    """The engine, the served model names and what every API's handlers share: model and
    runner checks, prompt validation, running prompts on the engine, usage and token text."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        *,
        enable_prompt_tokens_details: bool = False,
        models: OpenAIServingModels | None = None,
        options: ServeOptions | None = None,
    ):
        """models: the registry of served names and LoRA adapters, shared by the app's APIs
        (default: one of served_model_names alone); options: the serve flags that change
        answers (default: all off)."""
        self.engine = engine
        self.options = options or ServeOptions()
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.model_names = served_model_names
        self.models = models or OpenAIServingModels(engine, served_model_names)
        if self.options.model is not None:  # the registry's root is the name the user gave
            self.models.model_id = self.options.model
        self.tokenizer = engine.get_tokenizer()
        self.defaults = engine.default_sampling
        self.max_model_len = engine.config.scheduler.max_model_len

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: a base model's name, or none);
        ModelNotFound (a 404) for an unknown name."""
        return self.models.resolve(model)

    def check_runner(self, api: str) -> None:
        """One server runs one kind of model (vLLM): generation or pooling."""
        pooling = self.engine.config.pooler is not None
        if pooling != (api == "Embeddings"):
            hint = "--runner pooling" if api == "Embeddings" else "without --runner pooling"
            raise ValueError(f"The model does not support the {api} API (serve it {hint})")

    # ------------------------------------------------------------------ prompts
    def completion_prompts(
        self, prompt: str | list[Any], field: str = "prompt"
    ) -> list[tuple[str | None, list[int]]]:
        """str | list[str] | list[int] | list[list[int]] -> [(text or None, token ids)]."""
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(_is_token_id(t) for t in prompt):
            prompts = [prompt]
        else:
            prompts = prompt
        if not prompts:
            raise ValueError(f"{field} must not be empty")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.engine.input_processor.tokenize(p))
            elif isinstance(p, list) and all(_is_token_id(t) for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError(
                    f"{field} must be a string, a list of strings, a list of token ids or a "
                    f"list of lists of token ids, got {type(p).__name__} inside the list"
                )
        return out

    def _validate(
        self,
        request_id: str,
        prompts,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        embeds: list | None = None,
    ) -> list[dict]:
        """Every prompt through the InputProcessor's checks before anything is queued; the
        prompts as AsyncLLM.generate takes them (with the request's cache_salt), and the
        adapter under "lora_request" (`_merged` hands it to generate)."""
        embeds = [{"prompt_embeds": e} for e in embeds or ()]  # after the token prompts
        if len(prompts) + len(embeds) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(
                f"a request may carry at most {MAX_PROMPTS_PER_REQUEST} prompts "
                f"(MAX_PROMPTS_PER_REQUEST), got {len(prompts)}"
            )
        if len(prompts) * params.n > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(
                f"a request may ask for at most {MAX_SEQUENCES_PER_REQUEST} sequences "
                f"(MAX_SEQUENCES_PER_REQUEST: prompts x n), got {len(prompts)} x {params.n}"
            )
        processor = self.engine.input_processor
        for i, (_, ids) in enumerate(prompts):
            processor.process(
                f"{request_id}-{i}",
                ids,
                params,
                priority=priority,
                cache_salt=cache_salt,
                lora_request=lora_request,
            )
        for i, prompt in enumerate(embeds):
            processor.process(
                f"{request_id}-e{i}",
                processor.tokenize(prompt)[1],
                params,
                priority=priority,
                **processor.prompt_extras(prompt),
            )
        extra = {} if cache_salt is None else {"cache_salt": cache_salt}
        if lora_request is not None:
            extra["lora_request"] = lora_request
        tokens = [{"prompt": text, "prompt_token_ids": ids} for text, ids in prompts]
        return [{**p, **extra} for p in tokens + embeds]

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
            prompt = dict(prompt)
            lora_request = prompt.pop("lora_request", None)
            try:
                async for out in self.engine.generate(
                    prompt,
                    params,
                    rid,
                    priority=priority,
                    data_parallel_rank=DATA_PARALLEL_RANK.get(),
                    kv_transfer_params=kv_transfer_params,
                    lora_request=lora_request,
                    trace_headers=TRACE_HEADERS.get(),
                ):
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

    def tokens_as_ids(self, request) -> bool:
        """Whether logprobs name tokens "token_id:N": the request's return_tokens_as_token_ids,
        else --return-tokens-as-token-ids."""
        asked = request.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if asked is None else asked

    def _token_text(self, token_id: int, lp, as_id: bool = False) -> str:
        """A logprob's token as text, or "token_id:N" (return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)


def usage_options(request, force: bool = False) -> tuple[bool, bool]:
    """(usage chunk at the end, usage in every chunk) from stream_options; force
    (--enable-force-include-usage): both, whatever the request asked (vLLM's)."""
    if force:
        return True, True
    options = request.stream_options
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, Any] | None] | None:
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


def top_logprobs(position: PositionLogprobs, k: int) -> list:
    """The top-k (token id, Logprob) of a position, best first (the chosen token is in the
    dict too, with its own rank, which may be past k); k -1: all of them (vLLM's)."""
    ranked = [
        (t, lp) for t, lp in position.items() if lp.rank is not None and (k < 0 or lp.rank <= k)
    ]
    return sorted(ranked, key=lambda item: item[1].rank)


def error_body(e: BaseException) -> ErrorResponse:
    status, kind = error_status(e)
    return ErrorResponse(ErrorInfo(str(e), kind, status))


def error_status(e: BaseException) -> tuple[int, str]:
    if isinstance(e, (EngineDeadError, EngineAsleepError)):
        return 503, "ServiceUnavailableError"
    if isinstance(e, ModelNotFound):
        return 404, "NotFoundError"
    if isinstance(e, (ValueError, msgspec.ValidationError, msgspec.DecodeError)):
        return 400, "BadRequestError"
    return 500, "InternalServerError"
