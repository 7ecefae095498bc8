"""OpenAIServingCompletion / OpenAIServingChat over AsyncLLM and a stand-in engine core (no
server, no model): a request's kv_transfer_params reach the EngineCoreRequest and a finished
output's reach the response's top level; --enable-prompt-tokens-details adds
usage.prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import PREFILL, FakeCore, config, handed_back

CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's


def call(tokenizer, body: dict, *, details: bool = False, cached: int = 0, defaults=None):
    """(the JSON body, or the SSE events, the server would send; the stand-in core).
    defaults: the generation config's default sampling parameters."""
    cfg = config(max_model_len=256)
    cfg.model.vocab_size = len(tokenizer)
    core = FakeCore(cached)
    chat = "messages" in body
    serving = (OpenAIServingChat if chat else OpenAIServingCompletion)(
        AsyncLLM(cfg, core, tokenizer=tokenizer, default_sampling=defaults),
        ["m"],
        enable_prompt_tokens_details=details,
    )
    request = msgspec.json.decode(
        json.dumps(body), type=ChatCompletionRequest if chat else CompletionRequest
    )
    prepared = (serving.prepare_chat if chat else serving.prepare_completion)(request)

    async def main():
        if request.stream:
            stream = serving.chat_stream if chat else serving.completion_stream
            return [chunk async for chunk in stream(request, prepared)]
        return await (serving.chat if chat else serving.completion)(request, prepared)

    try:
        result = asyncio.run(main())
    finally:
        serving.engine.shutdown()
    if isinstance(result, list):
        events = [c.removeprefix(b"data: ").strip() for c in result]
        assert events[-1] == b"[DONE]"
        return [json.loads(e) for e in events[:-1]], core
    return json.loads(msgspec.json.encode(result)), core


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_kv_transfer_params_reach_the_core_and_the_response(tokenizer, kind):
    body = {"messages": CHAT} if kind == "chat" else {"prompt": [[1, 2, 3], [4, 5]]}
    plain, core = call(tokenizer, body)
    assert plain["kv_transfer_params"] is None  # vLLM's null
    assert all(r.kv_transfer_params is None for r in core.requests)

    answer, core = call(tokenizer, {**body, "kv_transfer_params": PREFILL})
    assert [r.kv_transfer_params for r in core.requests] == [PREFILL] * len(core.requests)
    assert answer["kv_transfer_params"] == handed_back(core.requests[0])  # the first prompt's
    assert answer["choices"] == plain["choices"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("details", [False, True])
def test_prompt_tokens_details_only_when_enabled(tokenizer, details, stream):
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    for body, cached in (
        ({"prompt": [[1] * 40, [2] * 40], "n": 2}, 2 * 32),  # once per prompt, not per choice
        ({"messages": CHAT}, 32),
    ):
        answer, _ = call(tokenizer, {**body, **extra}, details=details, cached=32)
        usage = answer[-1]["usage"] if stream else answer["usage"]
        # vLLM's: a whole answer's usage has every field (null: none), a stream's those it set
        nulls = {} if stream else {"created_cache_tokens": None, "multimodal_tokens": None}
        if details:
            assert usage["prompt_tokens_details"] == {"cached_tokens": cached, **nulls}
        elif stream:
            assert "prompt_tokens_details" not in usage
        else:
            assert usage["prompt_tokens_details"] is None
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_generation_config_defaults_fill_unset_fields_and_cap_max_tokens(tokenizer, kind):
    """vLLM's: the generation config's values stand in for the fields a request leaves unset;
    its max_tokens (max_new_tokens) caps what any request asks for."""
    defaults = {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "max_tokens": 5}
    body = {"messages": CHAT} if kind == "chat" else {"prompt": [[1, 2, 3]]}
    for asked, expected in (
        ({}, (0.6, 0.9, 0.05, 5)),
        ({"temperature": 0.2, "max_tokens": 3}, (0.2, 0.9, 0.05, 3)),
        ({"top_p": 0.5, "min_p": 0.0, "max_tokens": 50}, (0.6, 0.5, 0.0, 5)),
    ):
        _, core = call(tokenizer, {**body, **asked}, defaults=defaults)
        (params,) = [r.sampling_params for r in core.requests]
        assert (params.temperature, params.top_p, params.min_p, params.max_tokens) == expected
    _, core = call(tokenizer, {**body, "max_tokens": 50})  # no generation config: no cap
    assert core.requests[0].sampling_params.max_tokens == 50
