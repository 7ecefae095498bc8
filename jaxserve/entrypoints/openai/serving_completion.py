"""/v1/completions (vLLM's `serving_completion.py`): prompts as text or token ids, several per
request, n choices each; echo, legacy logprobs, prompt_logprobs; whole or streamed."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator

import msgspec

from jaxserve.entrypoints.beam_search import BeamSearch, beam_search_async, check_beam_width
from jaxserve.entrypoints.openai.prompt_embeds import decode_prompt_embeds
from jaxserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    check_supported,
    random_id,
    to_sampling_params,
)
from jaxserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    TRACE_HEADERS,
    OpenAIServing,
    error_body,
    prompt_logprobs_json,
    sse,
    top_logprobs,
    usage_options,
)
from jaxserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jaxserve.sampling_params import BeamSearchParams


class OpenAIServingCompletion(OpenAIServing):
    def prepare_completion(self, request: CompletionRequest):
        lora_request = self.check_model(request.model)
        self.check_runner("Completions")
        check_supported(request)
        embeds = self._prompt_embeds(request)
        prompts = (
            [] if request.prompt is None and embeds else self.completion_prompts(request.prompt)
        )
        params = to_sampling_params(
            request, self.defaults, max_tokens=request.max_tokens, logprobs=request.logprobs
        )
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params = msgspec.structs.replace(params, prompt_logprobs=request.logprobs)
        request_id = random_id("cmpl")
        validated = self._validate(
            request_id, prompts, params, priority=request.priority,
            cache_salt=request.cache_salt, lora_request=lora_request, embeds=embeds,
        )  # fmt: skip
        return request_id, validated, params

    def _prompt_embeds(self, request: CompletionRequest) -> list:
        """The request's prompt_embeds, decoded (prompt_embeds.py) within [max_model_len,
        hidden size]; ValueError, before anything is decoded, without --enable-prompt-embeds
        and for what they cannot be used with."""
        if request.prompt_embeds is None:
            return []
        processor = self.engine.input_processor
        if processor.prompt_embeds_size is None:
            raise ValueError("prompt_embeds are refused: the server needs --enable-prompt-embeds")
        encoded = request.prompt_embeds
        encoded = [encoded] if isinstance(encoded, str) else encoded
        if not encoded:
            raise ValueError("prompt_embeds must not be empty")
        for field in ("echo", "use_beam_search"):
            if getattr(request, field):
                raise ValueError(f"{field} cannot be used with prompt_embeds")
        hidden, positions = processor.prompt_embeds_size, processor.max_model_len
        return [
            decode_prompt_embeds(e, hidden_size=hidden, max_positions=positions) for e in encoded
        ]

    async def completion(self, request: CompletionRequest, prepared) -> CompletionResponse:
        request_id, prompts, params = prepared
        if request.use_beam_search:
            return await self._beam_search(request, prepared)
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
                    logprobs = self._completion_logprobs(out, c, request.echo, request)
                choice = CompletionChoice(
                    p * params.n + c.index, text, logprobs, c.finish_reason, c.stop_reason
                )
                if request.prompt_logprobs is not None:
                    choice.prompt_logprobs = prompt_logprobs_json(out)
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
        if request.use_beam_search:  # one chunk per choice once the search ends (as vLLM)
            async for chunk in self._beam_search_stream(request, prepared):
                yield chunk
            return
        created, model = int(time.time()), self._name(request.model)
        include_usage, continuous = usage_options(request)
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
                        logprobs = self._completion_logprobs(out, c, False, request)
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

    async def _beam_search(self, request: CompletionRequest, prepared) -> CompletionResponse:
        """use_beam_search: n beams per prompt (entrypoints/beam_search.py), the n best as
        the prompt's choices, best first; each choice's text is its generated tokens'."""
        request_id, prompts, params = prepared
        processor = self.engine.input_processor
        beam_params = BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens or processor.max_model_len,
            ignore_eos=params.ignore_eos, temperature=params.temperature,
            length_penalty=request.length_penalty,
        )  # fmt: skip
        check_beam_width(beam_params, processor.max_logprobs)
        search = BeamSearch([p["prompt_token_ids"] for p in prompts], beam_params,
                            processor.eos_token_id, processor.max_model_len)  # fmt: skip
        extra = {k: v for k, v in prompts[0].items() if k in ("cache_salt", "lora_request")}
        steps = itertools.count()

        async def run_one(tokens: list[int], step_params, i: int) -> RequestOutput:
            final = None
            async for out in self.engine.generate(
                {"prompt_token_ids": tokens, **extra}, step_params,
                f"{request_id}-beam{next(steps)}", priority=request.priority,
                trace_headers=TRACE_HEADERS.get(),
            ):  # fmt: skip
                final = out
            return final

        await beam_search_async(search, run_one)
        choices, completion_tokens = [], 0
        for p, result in enumerate(search.results()):
            for j, beam in enumerate(result.sequences):
                ids = beam.output_token_ids
                completion_tokens += len(ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
                if request.echo:
                    text = (prompts[p]["prompt"] or "") + text
                choices.append(CompletionChoice(p * params.n + j, text, None, beam.finish_reason))
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        usage = self._usage(prompt_tokens, completion_tokens, 0)
        return CompletionResponse(
            request_id, int(time.time()), self._name(request.model), choices, usage
        )

    async def _beam_search_stream(self, request: CompletionRequest, prepared):
        try:
            response = await self._beam_search(request, prepared)
            for choice in response.choices:
                yield sse(msgspec.structs.replace(response, choices=[choice], usage=None))
            if usage_options(request)[0]:
                yield sse(msgspec.structs.replace(response, choices=[]))
        except Exception as e:
            yield sse(error_body(e))
        yield SSE_DONE

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def _completion_logprobs(
        self, out: RequestOutput, c: CompletionOutput, echo: bool, request: CompletionRequest
    ) -> dict:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
        k, as_id = request.logprobs, request.return_tokens_as_token_ids
        ids: list[int] = []
        positions: list[PositionLogprobs | None] = []
        if echo:
            ids += out.prompt_token_ids
            positions += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        ids += c.token_ids
        positions += c.logprobs or []
        tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
        for token_id, position in zip(ids, positions, strict=True):
            text = self._token_text(token_id, position.get(token_id) if position else None, as_id)
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
                {
                    self._token_text(t, lp, as_id): lp.logprob
                    for t, lp in [*top_logprobs(position, k), *chosen]
                }
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
