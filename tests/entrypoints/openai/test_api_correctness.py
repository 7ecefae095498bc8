"""What a vLLM user hits first against `jaxserve serve` (issue 15): streams with n > 1,
logprobs edge cases, 64-bit integers, bad values rejected up front with a 400 that names the
field, OpenAI-style errors everywhere, and the message and stream fields vLLM accepts. The
server is the package's shared one (conftest.py)."""

from __future__ import annotations

import collections
import math
import subprocess
import sys

import httpx
import pytest

from tests.require import import_or_skip

openai = import_or_skip("openai")  # absent on the GPU machine: skip (fail in CI: require.py)

from tests.entrypoints.openai.test_api_server import (  # noqa: E402
    CHAT,
    KEY,
    MODEL,
    auth,
    keyed_post,
    sse_events,
)

pytestmark = pytest.mark.slow


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", f"{server.url}/v1/{path}", json={"model": MODEL, "stream": True, **body},
        headers=auth(), timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/{path}", json={"model": MODEL, **body}, headers=auth(), timeout=120
    )


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_stream_with_n_ends_each_choice_once(server, path):
    # Sampled children stop at their own EOS or stop string, at different steps.
    prompt = {"prompt": "List some animals:"} if path == "completions" else {"messages": CHAT}
    chunks = stream(
        server, path, {**prompt, "n": 4, "max_tokens": 24, "temperature": 1.0, "seed": 7,
                       "stop": [","]},
    )  # fmt: skip
    finishes = collections.Counter()
    last_index_step = {}
    for step, chunk in enumerate(chunks):
        for choice in chunk["choices"]:
            assert finishes[choice["index"]] == 0, f"a chunk after choice {choice['index']} ended"
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] += 1
                last_index_step[choice["index"]] = step
    assert finishes == {i: 1 for i in range(4)}
    assert len(set(last_index_step.values())) > 1  # they did end at different steps


def test_logprobs_without_top_logprobs(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, temperature=0
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert all(c.top_logprobs == [] and c.logprob <= 0 for c in content)
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    # logprobs 0: the sampled token only
    assert all(list(top) == [tok] for top, tok in zip(lp.top_logprobs, lp.tokens, strict=True))


def test_chat_stream_sends_every_tokens_logprobs(server):
    """Tokens whose text the detokenizer holds back (here: a lone UTF-8 lead byte, forced
    by logit_bias, which never completes a character) still get their logprobs entry."""
    from jaxserve.transformers_utils.tokenizer import read_tokenizer

    lead_byte = read_tokenizer(None).get_vocab()["\u00f0"]  # byte 0xF0, a 4-byte lead
    body = {"messages": CHAT, "max_tokens": 12, "logprobs": True, "top_logprobs": 2,
            "temperature": 0, "logit_bias": {str(lead_byte): 100},
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = stream(server, "chat/completions", body)
    entries = [
        e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]  # fmt: skip
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert len(entries) == 12
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_completions_top_logprobs_hold_the_sampled_token(client):
    out = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=24, logprobs=1, temperature=2.0,
        seed=11, extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob)
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the top 1


def test_64_bit_seeds_and_priorities(server):
    bad = post(server, "completions", {"prompt": "Hi", "seed": 2**70})
    assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]
    bad = post(server, "completions", {"prompt": "Hi", "priority": 2**70})
    assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]
    bad = post(server, "completions", {"prompt": "Hi", "seed": 2**63})
    assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]
    # The largest seed with n > 1 (children count on past 2**63 - 1, wrapping), and seeds
    # that agree in their low 32 bits give different samples.
    ok = post(server, "completions", {"prompt": "Hi", "seed": 2**63 - 1, "n": 3, "max_tokens": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3
    texts = []
    for seed in (-1, 2**32 - 1, 5, 5 + 2**32):
        r = post(server, "completions", {"prompt": "Hi", "seed": seed, "max_tokens": 16,
                                         "temperature": 1.5, "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] != texts[1] and texts[2] != texts[3]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("completions", {"prompt": "Hi", "n": 1000}, "n"),
        ("chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, "role"),
        ("completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("completions", {"prompt": "Hi", "logit_bias": {"42": "high"}}, "logit_bias"),
        ("completions", {"prompt": "Hi", "stop_token_ids": [10**7]}, "stop_token_ids"),
        ("completions", {"prompt": "Hi", "seed": -(2**63) - 1}, "seed"),
        ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
         "max_completion_tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "content"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ],
)  # fmt: skip
def test_bad_values_are_a_400_naming_the_field(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and error["code"] == 400 and error["type"]


def test_huge_prompt_is_refused_without_tokenizing(server):
    r = post(server, "completions", {"prompt": "a" * 10_000_000})
    assert r.status_code == 400
    assert "characters" in r.json()["error"]["message"]  # refused before tokenizing
    assert post(server, "completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_404_and_405_are_openai_errors(server):
    r = httpx.get(f"{server.url}/v1/no-such-route", headers=auth())
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(f"{server.url}/v1/completions", headers=auth())
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert "GET" in r.json()["error"]["message"]


def test_content_parts_and_null_content(client):
    parts = [{"type": "text", "text": t} for t in ("What is the capital", "of France?")]
    as_parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], temperature=0, max_tokens=8
    )
    as_text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital\nof France?"}],
        temperature=0, max_tokens=8,
    )  # fmt: skip
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    history = [*CHAT, {"role": "assistant", "content": None}, {"role": "user", "content": "Why?"}]
    out = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_continuous_usage_stats(server, path):
    prompt = {"prompt": "Hi"} if path == "completions" else {"messages": CHAT}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(server, path, {**prompt, "max_tokens": 6, "ignore_eos": True,
                                   "stream_options": options})  # fmt: skip
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert len({u["prompt_tokens"] for u in usages}) == 1


def test_prompt_logprobs_without_echo(server):
    count = keyed_post(server, "/tokenize", {"prompt": "The capital of France"}).json()
    r = post(server, "completions", {"prompt": "The capital of France", "max_tokens": 2,
                                     "prompt_logprobs": 1})  # fmt: skip
    assert r.status_code == 200
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == count["count"] and plp[0] is None
    for position, token in zip(plp[1:], count["tokens"][1:], strict=True):
        assert str(token) in position and 1 <= len(position) <= 2
        assert all(math.isfinite(v["logprob"]) and v["logprob"] <= 0 for v in position.values())
    chat = post(server, "chat/completions", {"messages": CHAT, "max_tokens": 2,
                                             "prompt_logprobs": 0})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    plain = post(server, "completions", {"prompt": "Hi", "max_tokens": 2})
    assert plain.json()["choices"][0]["prompt_logprobs"] is None  # vLLM's null


def test_n_above_the_limit_names_it(client):
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        client.completions.create(model=MODEL, prompt="Hi", n=129)


def test_serve_takes_the_model_as_a_flag_too():
    from jaxserve.entrypoints.cli import parse_args

    assert parse_args(["serve", "--model", "m"]).model == "m"
    assert parse_args(["serve", "m", "--model", "m"]).model == "m"
    assert parse_args(["serve", "m"]).model == "m"
    with pytest.raises(SystemExit):
        parse_args(["serve", "a", "--model", "b"])


def test_chat_and_complete_clients(server):
    """`jaxserve chat` with scripted stdin keeps the conversation (the second request's prompt
    holds the first answer); `jaxserve complete --quick` answers once."""
    cli = [sys.executable, "-m", "jaxserve.entrypoints.cli"]
    before = server.metric("prompt_tokens_total")
    chat = subprocess.run(
        [*cli, "chat", "--url", f"{server.url}/v1", "--api-key", KEY, "--max-tokens", "8",
         "--system-prompt", "Answer briefly."],
        input="What is the capital of France?\nAnd of Italy?\n", capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert f"Using model: {MODEL}" in chat.stderr
    assert chat.stdout.strip()
    first = server.metric("prompt_tokens_total") - before
    assert first > 2 * 20  # two requests, the second with the history
    quick = subprocess.run(
        [*cli, "complete", "--url", f"{server.url}/v1", "--api-key", KEY, "--max-tokens", "4",
         "--quick", "The capital of France is"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert quick.returncode == 0 and quick.stdout.strip(), quick.stderr
    wrong = subprocess.run(
        [*cli, "complete", "--url", f"{server.url}/v1", "--model-name", "nope", "--api-key", KEY,
         "--quick", "Hi"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "does not exist" in wrong.stderr
