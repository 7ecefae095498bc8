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
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    UsageInfo,
    check_supported,
    random_id,
    to_sampling_params,
)
from jaxserve.entrypoints.openai.request_values import logprobs_count
from jaxserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    TRACE_HEADERS,
    OpenAIServing,
    error_body,
    prompt_logprobs_json,
    sse,
    usage_options,
)
from jaxserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jaxserve.sampling_params import BeamSearchParams


class OpenAIServingCompletion(OpenAIServing):
    def prepare_completion(self, request: CompletionRequest):
        lora_request = self.check_model(request.model)
        self.check_runner("Completions")
        check_supported(request)
        no_prompt = request.prompt in (None, "")
        if no_prompt and not request.prompt_embeds:  # vLLM's words
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        vocab = self.engine.input_processor.vocab_size  # -1: every token (vLLM's)
        request = msgspec.structs.replace(
            request,
            logprobs=logprobs_count("logprobs", request.logprobs, vocab),
            prompt_logprobs=logprobs_count("prompt_logprobs", request.prompt_logprobs, vocab),
        )
        embeds = self._prompt_embeds(request)
        prompts = [] if no_prompt else self.completion_prompts(request.prompt)
        params = to_sampling_params(
            request, self.defaults, max_tokens=request.max_tokens, logprobs=request.logprobs
        )
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params = msgspec.structs.replace(params, prompt_logprobs=request.logprobs)
        request_id = random_id("cmpl")
        validated = self._validate(
            request_id,
            prompts,
            params,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=lora_request,
            embeds=embeds,
        )
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
        with_ids = bool(request.return_token_ids)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text, logprobs = self._piece(request, out, c, request.echo, out.prompt_logprobs)
                choices.append(
                    CompletionChoice(
                        p * params.n + c.index,
                        text,
                        logprobs,
                        c.finish_reason,
                        c.stop_reason,
                        token_ids=list(c.token_ids) if with_ids else None,
                        prompt_logprobs=prompt_logprobs_json(out),  # with echo's too (vLLM)
                        prompt_token_ids=list(out.prompt_token_ids) if with_ids else None,
                    )
                )
        cached = sum(out.num_cached_tokens for out in finals)
        usage = self._usage(prompt_tokens, completion_tokens, cached)
        return CompletionResponse(
            request_id,
            int(time.time()),
            self._name(request.model),
            choices,
            usage,
            kv_transfer_params=finals[0].kv_transfer_params,
        )

    async def completion_stream(self, request: CompletionRequest, prepared) -> AsyncIterator[bytes]:
        """vLLM's chunks: a choice's first carries its prompt's token ids (with echo, or with
        return_token_ids), each its own new token ids (return_token_ids); usage per chunk with
        continuous_usage_stats or --enable-force-include-usage, and a usage chunk at the end."""
        request_id, prompts, params = prepared
        if request.use_beam_search:  # one chunk per choice once the search ends (as vLLM)
            async for chunk in self._beam_search_stream(request, prepared):
                yield chunk
            return
        created, model = int(time.time()), self._name(request.model)
        include_usage, continuous = usage_options(request, self.options.enable_force_include_usage)
        with_ids = bool(request.return_token_ids)
        prompt_tokens: dict[int, int] = {}  # per prompt
        cached: dict[int, int] = {}
        prompt_lps: dict[int, list] = {}  # a prompt's logprobs come with its first output only
        generated: dict[int, int] = {}  # per choice: tokens so far
        offsets: dict[int, int] = {}  # per choice: the text_offset of its next token
        try:
            async for p, out in self._merged(
                request_id, prompts, params, request.priority, request.kv_transfer_params
            ):
                cached[p], prompt_tokens[p] = out.num_cached_tokens, len(out.prompt_token_ids)
                if out.prompt_logprobs is not None:
                    prompt_lps[p] = out.prompt_logprobs
                for c in out.outputs:
                    i = p * params.n + c.index
                    first = i not in generated
                    echo = request.echo and first
                    if not echo and not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    generated[i] = generated.get(i, 0) + len(c.token_ids)
                    text, logprobs = self._piece(
                        request, out, c, echo, prompt_lps.get(p), offsets.get(i, 0)
                    )
                    if logprobs is not None and logprobs["tokens"]:
                        offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    choice = CompletionStreamChoice(
                        i,
                        text,
                        logprobs,
                        c.finish_reason,
                        c.stop_reason,
                        prompt_token_ids=(
                            list(out.prompt_token_ids) if first and (echo or with_ids) else None
                        ),
                        token_ids=list(c.token_ids) if with_ids else None,
                    )
                    chunk = CompletionChunk(request_id, created, model, [choice])
                    if continuous:  # the choice's own counts (vLLM's)
                        chunk.usage = UsageInfo.of(prompt_tokens[p], generated[i])
                    yield sse(chunk)
            if include_usage:
                usage = self._usage(
                    sum(prompt_tokens.values()), sum(generated.values()), sum(cached.values())
                )
                yield sse(CompletionChunk(request_id, created, model, [], usage))
        except Exception as e:
            yield sse(error_body(e))
        yield SSE_DONE

    async def _beam_search(self, request: CompletionRequest, prepared) -> CompletionResponse:
        """use_beam_search: n beams per prompt (entrypoints/beam_search.py), the n best as
        the prompt's choices, best first; each choice's text is its generated tokens'."""
        request_id, prompts, params = prepared
        processor = self.engine.input_processor
        beam_params = BeamSearchParams(
            beam_width=params.n,
            max_tokens=params.max_tokens or processor.max_model_len,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            length_penalty=request.length_penalty,
        )
        check_beam_width(beam_params, processor.max_logprobs)
        search = BeamSearch(
            [p["prompt_token_ids"] for p in prompts],
            beam_params,
            processor.eos_token_id,
            processor.max_model_len,
        )
        extra = {k: v for k, v in prompts[0].items() if k in ("cache_salt", "lora_request")}
        steps = itertools.count()

        async def run_one(tokens: list[int], step_params, i: int) -> RequestOutput:
            final = None
            async for out in self.engine.generate(
                {"prompt_token_ids": tokens, **extra},
                step_params,
                f"{request_id}-beam{next(steps)}",
                priority=request.priority,
                trace_headers=TRACE_HEADERS.get(),
            ):
                final = out
            return final

        await beam_search_async(search, run_one)
        with_ids = bool(request.return_token_ids)
        choices, completion_tokens = [], 0
        for p, result in enumerate(search.results()):
            prompt_ids = prompts[p]["prompt_token_ids"]
            for j, beam in enumerate(result.sequences):
                ids = beam.output_token_ids
                completion_tokens += len(ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
                if request.echo and not with_ids:  # with token ids: those tell the prompt
                    text = (prompts[p]["prompt"] or "") + text
                choices.append(
                    CompletionChoice(
                        p * params.n + j,
                        text,
                        None,
                        beam.finish_reason,
                        token_ids=list(ids) if with_ids else None,
                        prompt_token_ids=list(prompt_ids) if with_ids else None,
                    )
                )
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        usage = self._usage(prompt_tokens, completion_tokens, 0)
        return CompletionResponse(
            request_id, int(time.time()), self._name(request.model), choices, usage
        )

    async def _beam_search_stream(self, request: CompletionRequest, prepared):
        include_usage, continuous = usage_options(request, self.options.enable_force_include_usage)
        try:
            r = await self._beam_search(request, prepared)
            usage = self._usage(r.usage.prompt_tokens, r.usage.completion_tokens, 0)
            for c in r.choices:
                choice = CompletionStreamChoice(
                    c.index,
                    c.text,
                    None,
                    c.finish_reason,
                    c.stop_reason,
                    c.prompt_token_ids,
                    c.token_ids,
                )
                chunk = CompletionChunk(r.id, r.created, r.model, [choice])
                if continuous:
                    chunk.usage = usage
                yield sse(chunk)
            if include_usage:
                yield sse(CompletionChunk(r.id, r.created, r.model, [], usage))
        except Exception as e:
            yield sse(error_body(e))
        yield SSE_DONE

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def _piece(
        self,
        request: CompletionRequest,
        out: RequestOutput,
        c: CompletionOutput,
        echo: bool,
        prompt_logprobs: list | None = None,
        offset: int = 0,
    ) -> tuple[str, dict | None]:
        """A choice's text and legacy logprobs (from text_offset `offset` on): its new tokens',
        after its prompt's with echo. With return_token_ids the prompt's text is left out (as
        vLLM does: prompt_token_ids tell it)."""
        text, ids, positions = c.text, list(c.token_ids), list(c.logprobs or ())
        if echo:
            text = ("" if request.return_token_ids else self._prompt_text(out)) + text
            ids = [*out.prompt_token_ids, *ids]
            positions = [*(prompt_logprobs or [None] * len(out.prompt_token_ids)), *positions]
        if request.logprobs is None:
            return text, None
        as_id = self.tokens_as_ids(request)
        return text, self._completion_logprobs(ids, positions, request.logprobs, as_id, offset)

    def _completion_logprobs(
        self,
        ids: list[int],
        positions: list[PositionLogprobs | None],
        k: int,
        as_id: bool,
        offset: int = 0,
    ) -> dict:
        """OpenAI's legacy shape for tokens `ids` and their positions' logprobs (None: none, as
        a prompt's first token has): tokens, token_logprobs, top_logprobs and text_offset
        (from `offset` on). A position's top_logprobs are its first k + 1 entries (all for k
        -1): the token itself first, then the most likely others (vLLM's order)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, position in zip(ids, positions, strict=True):
            chosen = position.get(token_id) if position else None
            text = self._token_text(token_id, chosen, as_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if chosen is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(max(chosen.logprob, -9999.0))
            listed = position.items() if k < 0 else itertools.islice(position.items(), k + 1)
            top.append(
                {self._token_text(t, lp, as_id): max(lp.logprob, -9999.0) for t, lp in listed}
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
