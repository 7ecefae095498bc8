"""/v1/chat/completions (vLLM's `serving_chat.py`): messages through the chat template, then
one prompt with n choices, each parsed into reasoning, content and tool calls
(`chat_utils.ChoiceParser`); whole or streamed. Image parts (`chat_media.py`) are counted
against the limit when the request is prepared, and fetched after it (`load_images`), before
anything reaches the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec

from jaxserve import envs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.chat_echo import echoed, response_role
from jaxserve.entrypoints.openai.chat_media import (
    check_image_count,
    default_chat_template,
    extract_images,
    image_placeholder,
    multimodal_config,
)
from jaxserve.entrypoints.openai.chat_utils import (
    CONTENT_FORMATS,
    ChoiceParser,
    check_template_kwargs,
    check_tools,
    content_format,
    render_chat,
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
    UsageInfo,
    check_supported,
    random_id,
    to_sampling_params,
)
from jaxserve.entrypoints.openai.request_values import logprobs_count
from jaxserve.entrypoints.openai.serve_options import ServeOptions
from jaxserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    error_body,
    prompt_logprobs_json,
    sse,
    top_logprobs,
    usage_options,
)
from jaxserve.entrypoints.openai.serving_models import OpenAIServingModels
from jaxserve.multimodal.media import DEFAULT_MAX_IMAGE_BYTES, fetch_images
from jaxserve.outputs import CompletionOutput


def template_kwargs(request: ChatCompletionRequest) -> dict | None:
    """The chat template's extra variables: chat_template_kwargs, over reasoning_effort."""
    if request.reasoning_effort is None:
        return request.chat_template_kwargs
    return {"reasoning_effort": request.reasoning_effort, **(request.chat_template_kwargs or {})}


class OpenAIServingChat(OpenAIServing):
    """The chat template and content format, and the tool and reasoning parsers (their
    names are checked here, as --default-chat-template-kwargs is, so a bad one fails when the
    server is built)."""

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
        trust_request_chat_template: bool = False,
        models: OpenAIServingModels | None = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        options: ServeOptions | None = None,
    ):
        """chat_template: None: the tokenizer's, else the model directory's
        (chat_media.default_chat_template); max_image_bytes: the most bytes one image of a
        message may have."""
        super().__init__(
            engine,
            served_model_names,
            models=models,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            options=options,
        )
        self.chat_template = chat_template or default_chat_template(self.tokenizer, engine.config)
        self.max_image_bytes = max_image_bytes
        self.trust_request_chat_template = trust_request_chat_template
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
        defaults = self.options.default_chat_template_kwargs
        if defaults and self.tokenizer is not None:  # as a request's would be checked
            try:
                check_template_kwargs(defaults, list(self.tokenizer.special_tokens_map))
            except ValueError as e:
                raise ValueError(f"--default-chat-template-kwargs: {e}") from None

    def chat_prompt(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt text and its token ids: the messages through the chat template (a
        request's own only with --trust-request-chat-template), rendered bounded in time
        and memory (chat_utils.render_chat); each image part as the model's marker."""
        text, ids, _ = self.render(self.with_default_kwargs(request))
        return text, ids

    def with_default_kwargs(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """The request with --default-chat-template-kwargs under its own chat_template_kwargs."""
        defaults = self.options.default_chat_template_kwargs
        if not defaults:
            return request
        kwargs = {**defaults, **(request.chat_template_kwargs or {})}
        return msgspec.structs.replace(request, chat_template_kwargs=kwargs)

    def render(self, request: ChatCompletionRequest) -> tuple[str, list[int], list[str]]:
        """chat_prompt's text and ids, and the URLs of the messages' images, in order
        (ValueError, before anything is fetched, for more than the limit allows)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if not request.messages:
            raise ValueError("messages must not be empty")
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise ValueError(
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template."
            )
        messages, image_urls = extract_images(request.messages)
        check_image_count(len(image_urls), self.engine.config)
        placeholder = image_placeholder(self.engine.config.model) if image_urls else None
        template = request.chat_template or self.chat_template
        fmt = content_format(template or self.tokenizer.chat_template, self.content_format)
        text = render_chat(
            self.tokenizer,
            template_messages(messages, fmt, placeholder),
            template=template,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            kwargs=template_kwargs(request),
            request_template=request.chat_template is not None,
        )
        self.engine.input_processor.check_text_length(text)
        mm = self.engine.input_processor.multimodal_processor if image_urls else None
        tokenized = text if mm is None else mm.expand_text(text)  # as HF's processor does
        return text, self.tokenizer(tokenized, add_special_tokens=False).input_ids, image_urls

    def prepare_chat(self, request: ChatCompletionRequest):
        self.check_runner("Chat Completions")
        request = self.with_default_kwargs(request)
        lora_request = self.check_model(request.model)
        check_supported(request)
        if request.use_beam_search:
            raise ValueError("use_beam_search is supported on /v1/completions only")
        check_tools(request, auto_tools=self.auto_tools)
        request = self._resolve_logprobs(request)
        if self.tool_parser_cls is not None and request.tools:
            request = self.tool_parser_cls(self.tokenizer).adjust_request(request)
        if self.reasoning_parser_cls is not None:
            request = self.reasoning_parser_cls(self.tokenizer).adjust_request(request)
        text, ids, image_urls = self.render(request)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.echo and request.prompt_logprobs is None and not request.stream:
            request = msgspec.structs.replace(request, prompt_logprobs=logprobs or 0)  # vLLM's
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
        validated = self._validate(
            request_id,
            [(text, ids)],
            params,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=lora_request,
        )
        if image_urls:  # fetched by load_images, off the tokenizer thread
            validated[0]["multi_modal_data"] = {"image": image_urls}
            validated[0]["mm_processor_kwargs"] = request.mm_processor_kwargs
        return request_id, validated, params

    def _resolve_logprobs(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """The request with top_logprobs and prompt_logprobs counted (-1: the vocabulary) and
        checked as vLLM checks them: top_logprobs above 0 needs logprobs, at most
        --max-logprobs; prompt_logprobs above 0 are not streamed, so a stream refuses them."""
        vocab = self.engine.input_processor.vocab_size
        top = logprobs_count("top_logprobs", request.top_logprobs, vocab)
        prompt = logprobs_count("prompt_logprobs", request.prompt_logprobs, vocab)
        if top and not request.logprobs:
            raise ValueError(f"top_logprobs={request.top_logprobs} needs logprobs to be true")
        max_logprobs = self.engine.input_processor.max_logprobs
        if top is not None and top > max_logprobs:
            raise ValueError(
                f"top_logprobs must be at most max_logprobs={max_logprobs} (-1: the whole "
                f"vocabulary, {vocab}), got {request.top_logprobs}"
            )
        if prompt and request.stream:
            raise ValueError(
                f"prompt_logprobs={request.prompt_logprobs} is not available when stream is true"
            )
        return msgspec.structs.replace(request, top_logprobs=top, prompt_logprobs=prompt)

    async def load_images(self, prepared):
        """prepare_chat's result with its image URLs fetched (concurrently, each within
        $JAXSERVE_IMAGE_FETCH_TIMEOUT s and --max-image-bytes, --allowed-media-domains and
        the address rules checked on every hop): the PIL images, in order."""
        request_id, prompts, params = prepared
        data = prompts[0].pop("multi_modal_data", None)
        if data is not None:
            mm = multimodal_config(self.engine.config)
            images = await fetch_images(
                data["image"],
                max_bytes=self.max_image_bytes,
                timeout=envs.JAXSERVE_IMAGE_FETCH_TIMEOUT,
                allowed_local_media_path=mm.allowed_local_media_path,
                allowed_media_domains=mm.allowed_media_domains,
            )
            # Processed (and the expanded prompt checked) before any response starts: a
            # problem is a 400 for a stream too, and the engine gets the features as they are.
            ip = self.engine.input_processor
            ids, features = await asyncio.to_thread(
                ip.process_multimodal,
                prompts[0]["prompt_token_ids"],
                {"image": images},
                prompts[0].pop("mm_processor_kwargs", None),
            )
            ip.process(f"{request_id}-0", ids, params, mm_features=features)
            prompts[0].update(prompt_token_ids=ids, mm_features=features)
        return prepared

    async def chat(self, request: ChatCompletionRequest, prepared) -> ChatCompletionResponse:
        request_id, prompts, params = prepared
        (out,) = await self._gather(
            request_id, prompts, params, request.priority, request.kv_transfer_params
        )
        choices, role, echo = [], response_role(request), echoed(request)
        for c in out.outputs:
            logprobs = self._chat_logprobs(c, request)
            message, called = self._choice_parser(request).full(c.text)
            message.role = role
            if request.echo:
                message.content = echo + (message.content or "")
            if not request.include_reasoning:
                message.reasoning = message.reasoning_content = None
            finish_reason = (
                "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
            )
            token_ids = list(c.token_ids) if request.return_token_ids else None
            choices.append(
                ChatChoice(c.index, message, logprobs, finish_reason, c.stop_reason, token_ids)
            )
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = self._usage(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens)
        response = ChatCompletionResponse(
            request_id,
            int(time.time()),
            self._name(request.model),
            choices,
            usage,
            prompt_token_ids=list(out.prompt_token_ids) if request.return_token_ids else None,
            prompt_text=out.prompt if request.return_prompt_text else None,
        )
        if params.prompt_logprobs is not None:  # asked for, or echo's (vLLM's)
            response.prompt_logprobs = prompt_logprobs_json(out)
        if out.kv_transfer_params is not None:
            response.kv_transfer_params = out.kv_transfer_params
        return response

    async def chat_stream(self, request: ChatCompletionRequest, prepared) -> AsyncIterator[bytes]:
        request_id, prompts, params = prepared
        created, model = int(time.time()), self._name(request.model)
        include_usage, continuous = usage_options(request, self.options.enable_force_include_usage)
        prompt_tokens, completion_tokens = len(prompts[0]["prompt_token_ids"]), 0
        cached = 0
        ids, text = prompts[0]["prompt_token_ids"], prompts[0]["prompt"]  # the role chunk's
        firsts = {
            "prompt_token_ids": list(ids) if request.return_token_ids else None,
            "prompt_text": text if request.return_prompt_text else None,
        }

        def chunk(choices, usage=None, **fields):
            if usage is None and continuous:  # vLLM's continuous usage has this null
                usage = UsageInfo.of(
                    prompt_tokens, completion_tokens, completion_tokens_details=None
                )
            return sse(ChatCompletionChunk(request_id, created, model, choices, usage, **fields))

        parsers = [self._choice_parser(request) for _ in range(params.n)]
        role, echo = response_role(request), echoed(request)
        try:
            for i in range(params.n):  # the role first, once per choice
                yield chunk([ChatStreamChoice(i, ChatMessage(role, ""))], **firsts)
            for i in range(params.n if echo else 0):  # then what echo repeats
                yield chunk([ChatStreamChoice(i, ChatMessage(content=echo))])
            async for _, out in self._merged(
                request_id, prompts, params, request.priority, request.kv_transfer_params
            ):
                cached = out.num_cached_tokens
                # with images, the engine's prompt: each marker expanded to its image's tokens
                prompt_tokens = len(out.prompt_token_ids or ()) or prompt_tokens
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
                    # Held-back text still sends its tokens' logprobs and ids, when asked for.
                    held = bool((request.logprobs or request.return_token_ids) and c.token_ids)
                    if delta is None and finish_reason is None and not held:
                        continue
                    logprobs = self._chat_logprobs(c, request)
                    ids = list(c.token_ids) if request.return_token_ids else None
                    delta, stop = delta or ChatMessage(), c.stop_reason
                    choice = ChatStreamChoice(c.index, delta, logprobs, finish_reason, stop, ids)
                    yield chunk([choice])
            if include_usage:
                yield chunk([], self._usage(prompt_tokens, completion_tokens, cached))
        except Exception as e:
            yield sse(error_body(e))
        yield SSE_DONE

    def _choice_parser(self, request: ChatCompletionRequest) -> ChoiceParser:
        return ChoiceParser(
            self.with_default_kwargs(request),
            self.tool_parser_cls,
            self.reasoning_parser_cls,
            self.tokenizer,
        )

    def _chat_logprobs(self, c: CompletionOutput, request: ChatCompletionRequest) -> dict | None:
        if not request.logprobs:
            return None
        k, as_id = request.top_logprobs or 0, self.tokens_as_ids(request)
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs or [], strict=True):
            chosen = position[token_id]
            text = self._token_text(token_id, chosen, as_id)
            content.append(
                {
                    "token": text,
                    "logprob": max(chosen.logprob, -9999.0),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t_text := self._token_text(t, lp, as_id)),
                            "logprob": max(lp.logprob, -9999.0),
                            "bytes": list(t_text.encode()),
                        }
                        for t, lp in top_logprobs(position, k)
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
