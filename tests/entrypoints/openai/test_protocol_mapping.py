"""Every field of /v1/completions and /v1/chat/completions, read back where it takes effect:
the EngineCoreRequest a stand-in core receives (sampling parameters, prompt, priority, salt)
or the answer (no server, no model). A protocol field without a row here fails the table
test, so a field can no longer be dropped without a word. Also: every integer a request sends
at 2^31, 2^63 and -1 is a 400 or what vLLM makes of it, never a crash; the refused fields and
the per-request limits are 400s naming them; unknown fields are logged in vLLM's words."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging

import msgspec
import pytest
import torch

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_engine import error_status
from jaxserve.ipc.messages import EngineCoreRequest
from jaxserve.sampling_params import RequestOutputKind
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import PREFILL, FakeCore, config

CHAT = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


class LogprobCore(FakeCore):
    """FakeCore whose single token (or `output`, without logprobs) comes with its logprob and
    one alternative."""

    output: list[int] | None = None

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        super().add_requests(requests)
        for r, out in zip(requests, self.pending[-len(requests) :], strict=True):
            if self.output is not None:
                out.new_token_ids = self.output
            elif r.sampling_params.logprobs is not None:
                out.logprobs = [([-0.5, -0.5, -1.0], [7, 7, 8], 1)]


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's


_SERVINGS: dict = {}


def run(
    tokenizer, body: dict, output: str | None = None, **serving_kw
) -> tuple[dict | list, list[EngineCoreRequest]]:
    """(the answer, the requests the core received; the core answers `output`'s tokens, else
    one token); raises what the server answers with a 4xx/5xx. One server per kind and
    options (a fresh stand-in core each run)."""
    chat = "messages" in body
    if chat:  # the table's request templates (test_http_hardening: refused without it)
        serving_kw = {"trust_request_chat_template": True, **serving_kw}
    key = (chat, tuple(sorted(serving_kw.items())))
    if key not in _SERVINGS:
        cfg = config(max_model_len=256)
        cfg.model.vocab_size = len(tokenizer)
        _SERVINGS[key] = (OpenAIServingChat if chat else OpenAIServingCompletion)(
            AsyncLLM(cfg, LogprobCore(), tokenizer=tokenizer), ["m"], **serving_kw
        )
    serving = _SERVINGS[key]
    core = serving.engine.engine_core = LogprobCore()
    if output is not None:
        core.output = tokenizer(output, add_special_tokens=False).input_ids
    request = decode_request(
        json.dumps(body).encode(), ChatCompletionRequest if chat else CompletionRequest
    )
    prepared = (serving.prepare_chat if chat else serving.prepare_completion)(request)

    async def main():
        try:
            if request.stream:
                stream = serving.chat_stream if chat else serving.completion_stream
                return [chunk async for chunk in stream(request, prepared)]
            return await (serving.chat if chat else serving.completion)(request, prepared)
        finally:
            if serving.engine.output_handler is not None:
                serving.engine.output_handler.cancel()

    result = asyncio.run(main())
    if isinstance(result, list):
        events = [c.removeprefix(b"data: ").strip() for c in result]
        return [json.loads(e) for e in events[:-1]], core.requests
    return json.loads(msgspec.json.encode(result)), core.requests


def so(r: EngineCoreRequest) -> dict:
    return msgspec.to_builtins(r.sampling_params.structured_outputs)


def sp(**expected):
    """A check: these SamplingParams fields on every request the core received."""

    def check(answer, requests, base):
        for r in requests:
            for name, value in expected.items():
                assert getattr(r.sampling_params, name) == value, name
        return True

    return check


def differs(answer, requests, base):
    """The prompt differs from the plain request's."""
    assert requests[0].prompt_token_ids != base[0].prompt_token_ids
    return True


REFUSED = "refused"  # a 400 naming the field
_buffer = io.BytesIO()
torch.save(torch.zeros(2, 4), _buffer)  # prompt_embeds as vLLM's clients send them
SAVED_ZEROS = base64.b64encode(_buffer.getvalue()).decode()
# field -> (the body's extra fields, a check(answer, requests, plain request's requests)).
COMMON = {
    "model": ({"model": "m"}, lambda a, r, b: a["model"] == "m"),
    "n": ({"n": 3}, lambda a, r, b: len(r) == 3 and sp(n=3)(a, r, b)),
    "temperature": ({"temperature": 0.5}, sp(temperature=0.5)),
    "top_p": ({"top_p": 0.5}, sp(top_p=0.5)),
    "top_k": ({"top_k": 5}, sp(top_k=5)),
    "min_p": ({"min_p": 0.25}, sp(min_p=0.25)),
    "presence_penalty": ({"presence_penalty": 0.5}, sp(presence_penalty=0.5)),
    "frequency_penalty": ({"frequency_penalty": 0.5}, sp(frequency_penalty=0.5)),
    "repetition_penalty": ({"repetition_penalty": 1.25}, sp(repetition_penalty=1.25)),
    "stop": ({"stop": "xy"}, sp(stop=["xy"])),
    "stop_token_ids": ({"stop_token_ids": [9]}, sp(stop_token_ids=[9])),
    "include_stop_str_in_output": (
        {"include_stop_str_in_output": True},
        sp(include_stop_str_in_output=True),
    ),
    "seed": ({"seed": 7}, sp(seed=7)),
    "stream": ({"stream": True}, sp(output_kind=RequestOutputKind.DELTA)),
    "stream_options": (
        {"stream": True, "stream_options": {"include_usage": True}},
        lambda a, r, b: isinstance(a, list) and a[-1]["choices"] == [] and "usage" in a[-1],
    ),
    "ignore_eos": ({"ignore_eos": True}, sp(ignore_eos=True)),
    "min_tokens": ({"min_tokens": 2}, sp(min_tokens=2)),
    "skip_special_tokens": ({"skip_special_tokens": False}, sp(skip_special_tokens=False)),
    "spaces_between_special_tokens": (
        {"spaces_between_special_tokens": False},
        sp(spaces_between_special_tokens=False),
    ),
    "logit_bias": ({"logit_bias": {"9": 1.5}}, sp(logit_bias={9: 1.5})),
    "allowed_token_ids": ({"allowed_token_ids": [9, 10]}, sp(allowed_token_ids=[9, 10])),
    "bad_words": (
        {"bad_words": ["hello"]},
        sp(bad_words=["hello"], bad_words_token_ids=[[28120], [33662]]),  # "hello", " hello"
    ),
    "truncate_prompt_tokens": (
        {"truncate_prompt_tokens": 2},
        lambda a, r, b: r[0].prompt_token_ids == b[0].prompt_token_ids[-2:],
    ),
    "prompt_logprobs": ({"prompt_logprobs": 2}, sp(prompt_logprobs=2)),
    "return_tokens_as_token_ids": (
        {"return_tokens_as_token_ids": True},  # with logprobs: see LOGPROBS
        lambda a, r, b: "token_id:7" in json.dumps(a),
    ),
    "return_token_ids": (  # the prompt's too (tests/entrypoints/openai/test_vllm_response_fields)
        {"return_token_ids": True},
        lambda a, r, b: a["choices"][0]["token_ids"] == [7],
    ),
    "logprob_token_ids": ({"logprob_token_ids": [9]}, REFUSED),
    "priority": ({"priority": 3}, lambda a, r, b: r[0].priority == 3),
    "cache_salt": ({"cache_salt": "s1"}, lambda a, r, b: r[0].cache_salt == "s1"),
    "user": ({"user": "u"}, lambda a, r, b: True),  # accepted, no effect (as vLLM)
    "best_of": ({"best_of": 2}, REFUSED),
    "response_format": (
        {"response_format": {"type": "json_object"}},
        lambda a, r, b: so(r[0]) == {"json_object": True},
    ),
    "structured_outputs": (
        {"structured_outputs": {"regex": "a+"}},
        lambda a, r, b: so(r[0]) == {"regex": "a+"},
    ),
    "guided_json": (
        {"guided_json": {"type": "object"}},
        lambda a, r, b: so(r[0]) == {"json": {"type": "object"}},
    ),  # fmt: skip
    "guided_regex": ({"guided_regex": "b+"}, lambda a, r, b: so(r[0]) == {"regex": "b+"}),
    "guided_choice": (
        {"guided_choice": ["p", "q"]},
        lambda a, r, b: so(r[0]) == {"choice": ["p", "q"]},
    ),
    "guided_grammar": (
        {"guided_grammar": 'root ::= "a"'},
        lambda a, r, b: so(r[0]) == {"grammar": 'root ::= "a"'},
    ),
    "guided_whitespace_pattern": (
        {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " ?"},
        lambda a, r, b: so(r[0])["whitespace_pattern"] == " ?",
    ),
    "kv_transfer_params": (
        {"kv_transfer_params": PREFILL},
        lambda a, r, b: r[0].kv_transfer_params == PREFILL,
    ),
}
COMPLETION = {
    "prompt": ({"prompt": "Hi there"}, differs),
    "max_tokens": ({"max_tokens": 5}, sp(max_tokens=5)),
    "logprobs": ({"logprobs": 2}, sp(logprobs=2)),
    "echo": ({"echo": True}, lambda a, r, b: a["choices"][0]["text"].startswith("Hello")),
    "suffix": ({"suffix": "x"}, REFUSED),
    # beam search: each step a one-token request with 2 x n logprobs per beam (the stand-in
    # core's two candidates, 7 and 8, grow the beams); n choices, best first
    "use_beam_search": (
        {"use_beam_search": True, "n": 2, "max_tokens": 2},
        lambda a, r, b: (
            sp(max_tokens=1, logprobs=4)(a, r, b)
            and len(r) == 1 + 2
            and [c["index"] for c in a["choices"]] == [0, 1]
        ),
    ),
    # without --enable-prompt-embeds a 400 naming it (with it: tests/entrypoints/
    # test_prompt_embeds.py), before the payload is decoded
    "prompt_embeds": ({"prompt_embeds": SAVED_ZEROS}, REFUSED),
    "length_penalty": (  # its effect on the ranking: tests/entrypoints/test_beam_search.py
        {"use_beam_search": True, "n": 2, "max_tokens": 2, "length_penalty": 0.5},
        lambda a, r, b: sp(max_tokens=1, logprobs=4)(a, r, b) and len(a["choices"]) == 2,
    ),
}
CHAT_ONLY = {
    "messages": ({"messages": [{"role": "user", "content": "Bye"}]}, differs),
    "max_tokens": ({"max_tokens": 5}, sp(max_tokens=5)),
    "max_completion_tokens": ({"max_completion_tokens": 6}, sp(max_tokens=6)),
    "logprobs": ({"logprobs": True}, sp(logprobs=0)),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, sp(logprobs=2)),
    "tools": (
        {"tools": [TOOL], "tool_choice": "required"},
        lambda a, r, b: so(r[0])["json"]["type"] == "array",
    ),
    "tool_choice": (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        lambda a, r, b: so(r[0]) == {"json": {"type": "object"}},
    ),
    "parallel_tool_calls": (
        {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
        lambda a, r, b: so(r[0])["json"]["maxItems"] == 1,
    ),
    "include_reasoning": (  # the model answers "x</think>y" (see REASONING)
        {"include_reasoning": False},
        lambda a, r, b: a["choices"][0]["message"].get("reasoning") is None,
    ),
    "add_generation_prompt": ({"add_generation_prompt": False}, differs),
    "return_prompt_text": (
        {"return_prompt_text": True},
        lambda a, r, b: a["prompt_text"].endswith(
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        ),
    ),
    # the image processor's options: a prompt without images runs as it would without them
    # (tests/models/test_vlm.py: they reach the image processor)
    "mm_processor_kwargs": (
        {"mm_processor_kwargs": {"max_pixels": 1000}},
        lambda a, r, b: r[0].prompt_token_ids == b[0].prompt_token_ids and not r[0].mm_features,
    ),
    "continue_final_message": (
        {
            "messages": [*CHAT, {"role": "assistant", "content": "Hi"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        lambda a, r, b: r[0].prompt_token_ids[-1] != b[0].prompt_token_ids[-1],
    ),  # fmt: skip
    "chat_template": (
        {"chat_template": "{{ messages[0]['content'] }}!"},
        lambda a, r, b: r[0].prompt_token_ids == TOKENS["Hello!"],
    ),
    "reasoning_effort": (  # the template's variable, as gpt-oss's template reads it
        {
            "chat_template": "{{ reasoning_effort }}{{ messages[0]['content'] }}!",
            "reasoning_effort": "high",
        },
        lambda a, r, b: r[0].prompt_token_ids == TOKENS["highHello!"],
    ),
    "chat_template_kwargs": (
        {
            "chat_template": "{{ x }}{{ messages[0]['content'] }}!",
            "chat_template_kwargs": {"x": "Hello"},
        },
        lambda a, r, b: r[0].prompt_token_ids == TOKENS["HelloHello!"],
    ),  # fmt: skip
    "echo": (  # the last message first when the answer continues it; prompt logprobs (vLLM)
        {
            "messages": [*CHAT, {"role": "assistant", "content": "Hi"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
        },
        lambda a, r, b: (
            a["choices"][0]["message"]["content"].startswith("Hi")
            and r[0].sampling_params.prompt_logprobs == 0
        ),
    ),
    "use_beam_search": ({"use_beam_search": True}, REFUSED),  # completions only
    "functions": ({"functions": [TOOL["function"]]}, REFUSED),
    "function_call": ({"function_call": "auto"}, REFUSED),
}
TOKENS: dict[str, list[int]] = {}
REASONING = {"reasoning_parser": "deepseek_r1", "output": "x</think>y"}
LOGPROBS = {"completion": {"logprobs": 1}, "chat": {"logprobs": True, "top_logprobs": 1}}


def test_every_protocol_field_has_a_row():
    assert set(CompletionRequest.__struct_fields__) == set(COMMON) | set(COMPLETION)
    assert set(ChatCompletionRequest.__struct_fields__) == set(COMMON) | set(CHAT_ONLY)


@pytest.mark.parametrize(
    ("kind", "field"),
    [("completion", f) for f in [*COMMON, *COMPLETION]]
    + [("chat", f) for f in [*COMMON, *CHAT_ONLY]],
)
def test_each_field_reaches_the_engine_request_or_is_refused(tokenizer, kind, field):
    for text in ("Hello!", "HelloHello!", "highHello!"):
        TOKENS[text] = tokenizer(text, add_special_tokens=False).input_ids
    table = COMMON | (COMPLETION if kind == "completion" else CHAT_ONLY)
    extra, check = table[field]
    base_body = {"prompt": "Hello"} if kind == "completion" else {"messages": CHAT}
    if field == "return_tokens_as_token_ids":
        base_body |= LOGPROBS[kind]
    serving_kw = REASONING if field == "include_reasoning" else {}
    base, base_requests = run(tokenizer, base_body, **serving_kw)
    if check is REFUSED:
        with pytest.raises(ValueError, match=field) as e:
            run(tokenizer, {**base_body, **extra})
        assert error_status(e.value)[0] == 400
        return
    answer, requests = run(tokenizer, {**base_body, **extra}, **serving_kw)
    assert check(answer, requests, base_requests)
    assert not check(base, base_requests, base_requests) if field in NOT_BY_DEFAULT else True


# Rows whose check must fail on the plain request (so the check sees the field's effect).
NOT_BY_DEFAULT = {"return_tokens_as_token_ids", "include_reasoning", "stream_options", "echo"}


BIG = [2**31, 2**63, -1]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("value", BIG)
@pytest.mark.parametrize(
    "field",
    ["top_k", "min_tokens", "max_tokens", "stop_token_ids", "allowed_token_ids", "logit_bias",
     "priority", "n", "logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens",
     "top_logprobs", "max_completion_tokens", "prompt"],
)  # fmt: skip
def test_integers_out_of_range_are_400s_or_what_vllm_makes_of_them(tokenizer, kind, field, value):
    base = {"prompt": "Hello"} if kind == "completion" else {"messages": CHAT}
    if field in ("top_logprobs", "max_completion_tokens") and kind == "completion":
        return
    if field == "prompt" and kind == "chat":
        return
    body = base | {
        "stop_token_ids": {field: [value]},
        "allowed_token_ids": {field: [value]},
        "logit_bias": {field: {str(value): 1.0}},
        "top_logprobs": {field: value, "logprobs": True},
        "prompt": {field: [[value]]},
        "logprobs": {field: value if kind == "completion" else True, "top_logprobs": value},
    }.get(field, {field: value})
    accepted = {  # vLLM: top_k past the vocabulary is no filter; any 64-bit seed or priority
        ("top_k", 2**31): sp(top_k=0),
        ("top_k", -1): sp(top_k=0),
        ("seed", 2**31): sp(seed=2**31),
        ("seed", -1): sp(seed=-1),
        ("priority", 2**31): lambda a, r, b: r[0].priority == 2**31,
        ("priority", -1): lambda a, r, b: r[0].priority == -1,
        ("truncate_prompt_tokens", -1): lambda a, r, b: True,  # max_model_len: the whole prompt
    }
    if (field, value) in accepted:
        answer, requests = run(tokenizer, body)
        assert accepted[field, value](answer, requests, None)
        return
    with pytest.raises((ValueError, msgspec.ValidationError)) as e:
        run(tokenizer, body)
    assert error_status(e.value)[0] == 400
    named = "top_logprobs|logprobs" if field == "logprobs" else field
    named = "token id" if field == "prompt" else named
    named = "max_completion_tokens" if field == "max_completion_tokens" else named
    assert e.match(named)


def test_limits_on_prompts_and_sequences_per_request(tokenizer):
    with pytest.raises(ValueError, match="MAX_PROMPTS_PER_REQUEST"):
        run(tokenizer, {"prompt": [[1]] * 2049, "max_tokens": 1})
    with pytest.raises(ValueError, match="MAX_SEQUENCES_PER_REQUEST"):
        run(tokenizer, {"prompt": [[1]] * 33, "n": 128, "max_tokens": 1})
    answer, requests = run(tokenizer, {"prompt": [[1]] * 32, "n": 128, "max_tokens": 1})
    assert len(requests) == 4096 and len(answer["choices"]) == 4096


def test_an_empty_cache_salt_is_refused(tokenizer):
    with pytest.raises(ValueError, match="cache_salt"):
        run(tokenizer, {"prompt": "Hello", "cache_salt": ""})


def test_unknown_fields_are_logged_once_in_vllms_words(caplog):
    with caplog.at_level(logging.WARNING):
        request = decode_request(
            b'{"prompt": "a", "frobnicate": 1, "top_k": 3, "zork": []}', CompletionRequest
        )
        decode_request(b'{"prompt": "a", "top_k": 3}', CompletionRequest)
    assert isinstance(request, CompletionRequest) and request.top_k == 3
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith("The following fields were present in the request but ignored")
    assert "frobnicate" in messages[0] and "zork" in messages[0]
    with pytest.raises(msgspec.ValidationError, match="top_k"):  # a real error still raises
        decode_request(b'{"prompt": "a", "top_k": "x", "zork": 1}', CompletionRequest)
