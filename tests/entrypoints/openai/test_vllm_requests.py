"""Chat and completion requests accepted and refused as vLLM 0.32.0 accepts and refuses them,
seen through the official openai client (issue 65, findings 8 and 10): custom message roles
reach the chat template; chat `echo` puts the last message first; `prompt_logprobs` /
`top_logprobs` / `logprobs` -1 mean the whole vocabulary; `"logprobs": "true"` is a boolean;
an echoed position's top_logprobs start with its own token; and vLLM's words for a seed out
of range, every bad logit_bias key and an empty prompt. In process, over a stand-in engine
core: the bundled model's tokenizer and chat template, no model (what reaches the core is
what decides the model's answer: a custom role's two content forms give the same prompt)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.ipc.messages import EngineCoreRequest
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import FakeCore, config
from tests.require import import_or_skip

openai = import_or_skip("openai")

SAYING = "Here is a common saying about apple. An apple a day, keeps"
CONTINUED = [
    {"role": "user", "content": "tell me a common saying"},
    {"role": "assistant", "content": SAYING},
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
SMALL_VOCAB = 100  # the completions tests' model: every logprob of a position is 100 entries


class VocabCore(FakeCore):
    """FakeCore (each request: token 7, then done) with the logprobs a request asks for, K per
    position: the position's own token first, then token ids 0..K-1 as the top-K (ranks
    1..K), so a token id of K or more ranks K + 1."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        super().add_requests(requests)
        for r, out in zip(requests, self.pending[-len(requests) :], strict=True):
            params = r.sampling_params
            if params.logprobs is not None:
                out.logprobs = [_row(7, params.logprobs)]
            if params.prompt_logprobs is not None:
                rows = [_row(t, params.prompt_logprobs) for t in r.prompt_token_ids[1:]]
                out.prompt_logprobs = tuple(np.array(column) for column in zip(*rows, strict=True))


def _row(token: int, k: int) -> tuple[list[float], list[int], int]:
    """(logprobs [K+1], token ids [K+1], the token's rank): the token, then ids 0..K-1."""
    top = [-0.01 * (j + 1) for j in range(k)]
    own = top[token] if token < k else -20.0
    return [own, *top], [token, *range(k)], token + 1 if token < k else k + 1


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's (it has a chat template)


def ask(tokenizer, calls, *, vocab_size: int | None = None, max_logprobs: int = 20):
    """What the official client gets for each of `calls` (async functions of an AsyncOpenAI
    client; a 4xx/5xx: its APIStatusError) from an app over a VocabCore, and the requests
    the core received. vocab_size: the model's (default: the tokenizer's); max_logprobs:
    --max-logprobs."""
    cfg = config(max_model_len=256)
    cfg.model.vocab_size = vocab_size or len(tokenizer)
    cfg.max_logprobs = max_logprobs
    core = VocabCore()
    engine = AsyncLLM(cfg, core, tokenizer=tokenizer)
    app = build_app(engine, ["m"], log_stats_interval=None)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="none", http_client=http, max_retries=0
            )
            results = []
            for call in calls:
                try:
                    results.append(await call(client))
                except openai.APIStatusError as e:
                    results.append(e)
            return results

    try:
        return asyncio.run(main()), core.requests
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)


def chat(messages, **kwargs):
    async def call(client):
        return await client.chat.completions.create(
            model="m", messages=messages, max_tokens=1, **kwargs
        )

    return call


def completion(prompt, **kwargs):
    async def call(client):
        return await client.completions.create(model="m", prompt=prompt, max_tokens=1, **kwargs)

    return call


def refusal(result) -> str:
    assert isinstance(result, openai.BadRequestError), result
    return result.message


# ---------------------------------------------------------------------- custom roles
def test_a_custom_role_reaches_the_chat_template_with_either_content_form(tokenizer):
    role = "my-custom-role"
    (text, parts, nameless), requests = ask(
        tokenizer,
        [
            chat([{"role": role, "content": "what is 1+1?"}]),
            chat([{"role": role, "content": [{"type": "text", "text": "what is 1+1?"}]}]),
            chat([{"content": "what is 1+1?"}]),
        ],
    )
    assert text.choices[0].message.content == parts.choices[0].message.content
    assert requests[0].prompt_token_ids == requests[1].prompt_token_ids
    assert role in tokenizer.decode(requests[0].prompt_token_ids)
    assert "messages[0].role" in refusal(nameless)


# ---------------------------------------------------------------------- echo
def test_chat_echo_puts_the_continued_message_first_whole_and_streamed(tokenizer):
    async def streamed(client):
        stream = await client.chat.completions.create(
            model="m",
            messages=CONTINUED,
            max_tokens=1,
            stream=True,
            extra_body={"echo": True, **CONTINUE},
        )
        return [chunk async for chunk in stream]

    (echoed, plain, after_prompt, chunks), _ = ask(
        tokenizer,
        [
            chat(CONTINUED, extra_body={"echo": True, **CONTINUE}),
            chat(CONTINUED, extra_body={"echo": False, **CONTINUE}),
            chat(CONTINUED[:1], extra_body={"echo": True}),  # a user turn: nothing to repeat
            streamed,
        ],
    )
    generated = plain.choices[0].message.content
    assert SAYING not in generated
    assert echoed.choices[0].message.content == SAYING + generated
    assert echoed.choices[0].message.role == "assistant"
    assert echoed.prompt_logprobs[0] is None and len(echoed.prompt_logprobs) > 1  # vLLM's
    assert after_prompt.choices[0].message.content == generated
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == SAYING
    assert "".join(d.content or "" for d in deltas) == SAYING + generated


def test_the_answer_takes_the_role_of_the_message_it_continues(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "my-custom-role", "content": "Hm"}]
    (answer,), _ = ask(tokenizer, [chat(messages, extra_body={"echo": True, **CONTINUE})])
    assert answer.choices[0].message.role == "my-custom-role"
    assert answer.choices[0].message.content.startswith("Hm")


# ---------------------------------------------------------------------- logprobs
def test_logprobs_as_the_string_true_and_top_logprobs_minus_one_give_the_whole_vocabulary(
    tokenizer,
):
    vocab = len(tokenizer)
    (every, maybe, as_text), _ = ask(
        tokenizer,
        [
            chat(CONTINUED[:1], extra_body={"top_logprobs": -1, "logprobs": "true"}),
            chat(CONTINUED[:1], extra_body={"logprobs": "maybe"}),
            chat(CONTINUED[:1], extra_body={"max_completion_tokens": "1"}),
        ],
        max_logprobs=vocab,  # --max-logprobs -1
    )
    (position,) = every.choices[0].logprobs.content
    assert len(position.top_logprobs) == vocab
    assert "logprobs" in refusal(maybe)
    assert "max_completion_tokens" in refusal(as_text)  # only booleans are read leniently


def test_prompt_logprobs_minus_one_is_every_token_within_max_logprobs(tokenizer):
    (whole, capped), requests = ask(
        tokenizer,
        [
            completion([50, 51, 52], extra_body={"prompt_logprobs": -1}),
            completion([50, 51, 52], logprobs=-1),
        ],
        vocab_size=SMALL_VOCAB,
        max_logprobs=SMALL_VOCAB,
    )
    positions = whole.choices[0].prompt_logprobs
    assert positions[0] is None and [len(p) for p in positions[1:]] == [SMALL_VOCAB] * 2
    assert requests[0].sampling_params.prompt_logprobs == SMALL_VOCAB
    assert len(capped.choices[0].logprobs.top_logprobs[0]) == SMALL_VOCAB
    (refused,), _ = ask(
        tokenizer,
        [chat(CONTINUED[:1], extra_body={"prompt_logprobs": -1})],
    )  # --max-logprobs 20
    assert "prompt_logprobs" in refusal(refused) and "max_logprobs=20" in refusal(refused)


def test_top_logprobs_zero_needs_no_logprobs_and_a_stream_refuses_prompt_logprobs(tokenizer):
    async def streamed(client):
        return await client.chat.completions.create(
            model="m",
            messages=CONTINUED[:1],
            max_tokens=1,
            stream=True,
            extra_body={"prompt_logprobs": 1},
        )

    (zero, stream), _ = ask(tokenizer, [chat(CONTINUED[:1], top_logprobs=0), streamed])
    assert zero.choices[0].logprobs is None
    assert "prompt_logprobs" in refusal(stream)


def test_echoed_top_logprobs_start_with_each_positions_own_token(tokenizer):
    (answer,), _ = ask(
        tokenizer,
        [completion([50, 51, 52], echo=True, logprobs=2)],
        vocab_size=SMALL_VOCAB,
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs.top_logprobs[0] is None
    firsts = [next(iter(top)) for top in logprobs.top_logprobs[1:]]
    assert firsts == logprobs.tokens[1:]  # not token 0, the top-1 of every position here
    assert all(len(top) == 3 for top in logprobs.top_logprobs[1:-1])  # own + top 2


# ---------------------------------------------------------------------- vLLM's words
def test_a_seed_outside_64_bits_names_the_bound_it_broke(tokenizer):
    results, _ = ask(
        tokenizer, [chat(CONTINUED[:1], seed=2**63), chat(CONTINUED[:1], seed=-(2**63) - 1)]
    )
    assert "less_than_equal" in refusal(results[0]) and "seed" in refusal(results[0])
    assert "greater_than_equal" in refusal(results[1]) and "seed" in refusal(results[1])


def test_logit_bias_names_every_bad_key_and_clamps_biases(tokenizer):
    vocab = len(tokenizer)
    (keys, word, value, beyond, clamped), requests = ask(
        tokenizer,
        [
            chat(CONTINUED[:1], logit_bias={"bad1": 50.0, "bad2": 20.0}),
            chat(CONTINUED[:1], logit_bias={"not_a_token_id": 50}),
            chat(CONTINUED[:1], logit_bias={"1": "not_a_number"}),
            chat(CONTINUED[:1], logit_bias={str(vocab + 1): 1.0}),
            chat(CONTINUED[:1], logit_bias={"5": 150.0, "6": -300}),
        ],
    )
    assert "bad1" in refusal(keys) and "bad2" in refusal(keys)
    assert "not_a_token_id" in refusal(word) and "logit_bias" in refusal(word)
    assert "logit_bias" in refusal(value)
    assert str(vocab + 1) in refusal(beyond) and str(vocab) in refusal(beyond)
    assert requests[-1].sampling_params.logit_bias == {5: 100.0, 6: -100.0}  # vLLM clamps


def test_an_empty_prompt_is_refused_in_vllms_words(tokenizer):
    words = "Either prompt or prompt_embeds must be provided and non-empty."
    results, _ = ask(
        tokenizer,
        [completion(None, extra_body={"prompt_embeds": []}), completion(""), completion(None)],
    )
    assert all(words in refusal(r) for r in results)
