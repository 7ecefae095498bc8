"""What /v1/completions and /v1/chat/completions answer, key for key as vLLM 0.32.0 sends it:
every field of a whole answer (null where there is nothing), a streamed chunk's fields by its
kind; return_token_ids (prompt_token_ids and token_ids, streams too); logprob tokens as
"token_id:N" (--return-tokens-as-token-ids, or per request); --enable-force-include-usage
(usage in every chunk); echo's prompt positions listing the prompt token first; /v1/models'
root the model as the user named it. The flag-gated answers come from the app in process
over a stand-in core whose sampled (and prompt) tokens are the second most likely; the rest
from the package's server on the bundled model, through the openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.serve_options import ServeOptions
from jaxserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import FakeCore, config
from tests.entrypoints.openai.test_api_server import MODEL, keyed_post
from tests.require import import_or_skip

CHAT = [{"role": "user", "content": "Hello"}]


def keys(names: str) -> set[str]:
    return set(names.split())


# vLLM 0.32.0's keys (its pydantic models' model_dump() for a whole answer; for a chunk,
# model_dump_json(exclude_unset=True) of what its serving code sets)
COMPLETION = keys(
    "id object created model choices service_tier system_fingerprint usage kv_transfer_params "
    "ec_transfer_params metrics"
)
COMPLETION_CHOICE = keys(
    "index text logprobs finish_reason stop_reason token_ids prompt_logprobs prompt_token_ids "
    "routed_experts"
)
CHAT_WHOLE = keys(
    "id object created model choices service_tier system_fingerprint usage prompt_logprobs "
    "prompt_token_ids prompt_text kv_transfer_params ec_transfer_params metrics"
)
CHAT_CHOICE = keys("index message logprobs finish_reason stop_reason token_ids routed_experts")
MESSAGE = keys("role content refusal annotations audio function_call reasoning")
USAGE = {"prompt_tokens", "total_tokens", "completion_tokens"}
CHUNK = {"id", "object", "created", "model", "choices"}
COMPLETION_CHUNK_CHOICE = keys(
    "index text logprobs finish_reason stop_reason prompt_token_ids token_ids"
)
CHAT_CHUNK_CHOICE = {"index", "delta", "logprobs", "finish_reason"}  # + by kind, below


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's


def other(token: int, j: int) -> int:
    """The j-th token the stand-in core ranks above or below `token` (never `token`)."""
    return token + 100 + j


def position(token: int, k: int) -> tuple[list[float], list[int], int]:
    """A position's logprobs as the core sends them (the token, then the top k): the token is
    the second most likely, after other(token, 0)."""
    ranked = [(other(token, 0), -0.5), (token, -1.0)] + [
        (other(token, j), -1.0 - j) for j in range(1, k)
    ]
    top = ranked[:k]
    return [-1.0] + [v for _, v in top], [token] + [t for t, _ in top], 2


class ScriptedCore(FakeCore):
    """A stand-in core: each request generates `tokens`, one a step, with their logprobs
    (position()) when asked for, and its prompt's logprobs likewise."""

    def __init__(self, tokens: list[int]):
        super().__init__()
        self.tokens = tokens
        self.steps: list[list[EngineCoreOutput]] = []

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for r in requests:
            k, m = r.sampling_params.logprobs, r.sampling_params.prompt_logprobs
            steps = []
            for j, token in enumerate(self.tokens):
                done = "length" if j == len(self.tokens) - 1 else None
                out = EngineCoreOutput(r.request_id, [token], done)
                out.logprobs = None if k is None else [position(token, k)]
                steps.append(out)
            if m is not None:
                rows = [position(t, m) for t in r.prompt_token_ids[1:]]
                steps[0].prompt_logprobs = tuple(
                    np.array([row[i] for row in rows]) for i in range(3)
                )
            self.steps.append(steps)

    def get_output(self) -> EngineCoreOutputs:
        outputs = [steps.pop(0) for steps in self.steps if steps]
        self.steps = [steps for steps in self.steps if steps]
        return EngineCoreOutputs(outputs)

    async def get_output_async(self) -> EngineCoreOutputs:
        # A pause before each step, so the server sends the last step's chunk first (there is
        # no real I/O between: every task waiting on it runs in the pause)
        await asyncio.sleep(0.01)
        while not self.steps:
            await asyncio.sleep(0.001)
        return self.get_output()


def run(tokenizer, calls, *, options: ServeOptions | None = None, tokens=(19556, 905)):
    """What `calls` (async functions of an openai.AsyncOpenAI client and an httpx client of
    the app over a ScriptedCore generating `tokens`) return."""
    openai = import_or_skip("openai")
    cfg = config(max_model_len=256)
    cfg.model.vocab_size = len(tokenizer)
    engine = AsyncLLM(cfg, ScriptedCore(list(tokens)), tokenizer=tokenizer)
    app = build_app(engine, ["m"], log_stats_interval=None, options=options or ServeOptions())

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="none", http_client=http, max_retries=0
            )
            return [await call(client, http) for call in calls]

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)


def post(path: str, body: dict):
    """A call: the JSON answer of POST /v1/{path}, or a stream's events."""

    async def call(client, http):
        r = await http.post(f"/v1/{path}", json={"model": "m", **body})
        assert r.status_code == 200, r.text
        if not body.get("stream"):
            return r.json()
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    return call


def test_whole_answers_have_every_field_vllm_sends(tokenizer):
    completion, chat = run(
        tokenizer,
        [post("completions", {"prompt": "Hi"}), post("chat/completions", {"messages": CHAT})],
    )
    assert set(completion) == COMPLETION and set(completion["choices"][0]) == COMPLETION_CHOICE
    assert set(chat) == CHAT_WHOLE and set(chat["choices"][0]) == CHAT_CHOICE
    assert set(chat["choices"][0]["message"]) == MESSAGE  # tool_calls only when there are some
    for answer in (completion, chat):
        assert set(answer["usage"]) == USAGE | {
            "prompt_tokens_details",
            "completion_tokens_details",
        }
        nulls = [k for k, v in answer.items() if v is None]
        assert "kv_transfer_params" in nulls and "system_fingerprint" in nulls
    assert chat["prompt_logprobs"] is None and completion["choices"][0]["prompt_logprobs"] is None


def test_streamed_chunks_have_the_fields_vllm_sets_for_their_kind(tokenizer):
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    calls = [
        post("completions", {"prompt": "Hi", **usage}),
        post("chat/completions", {"messages": CHAT, **usage}),
    ]
    completion, chat = run(tokenizer, calls)
    *chunks, last = completion
    assert len(chunks) == 2  # one a token
    for c in chunks:
        assert set(c) == CHUNK and set(c["choices"][0]) == COMPLETION_CHUNK_CHOICE
    role, *content, last_chat = chat
    assert set(role) == CHUNK | {"prompt_token_ids", "prompt_text"}
    assert set(role["choices"][0]) == CHAT_CHUNK_CHOICE
    assert role["prompt_token_ids"] is None and role["prompt_text"] is None
    assert [set(c["choices"][0]) for c in content] == [
        CHAT_CHUNK_CHOICE | {"token_ids"},
        CHAT_CHUNK_CHOICE | {"token_ids", "stop_reason"},  # the finishing chunk
    ]
    assert all(set(c) == CHUNK for c in content)
    for end in (last, last_chat):  # the usage chunk: no nulls
        assert set(end) == CHUNK | {"usage"} and end["choices"] == []
        assert set(end["usage"]) == USAGE


def test_return_token_ids_whole_and_streamed(tokenizer):
    ids, prompt_ids = [19556, 905], tokenizer("Hi").input_ids
    asked = {"return_token_ids": True}
    calls = [
        post("completions", {"prompt": "Hi", **asked}),
        post("completions", {"prompt": "Hi", "stream": True, **asked}),
        post("chat/completions", {"messages": CHAT, **asked}),
        post("chat/completions", {"messages": CHAT, "stream": True, **asked}),
    ]
    completion, completion_stream, chat, chat_stream = run(tokenizer, calls)
    choice = completion["choices"][0]
    assert choice["token_ids"] == ids and choice["prompt_token_ids"] == prompt_ids
    first, second = (c["choices"][0] for c in completion_stream)
    assert first["prompt_token_ids"] == prompt_ids and second["prompt_token_ids"] is None
    assert first["token_ids"] + second["token_ids"] == ids
    chat_prompt = chat["prompt_token_ids"]
    assert tokenizer.decode(chat_prompt).endswith("Hello<|im_end|>\n<|im_start|>assistant\n")
    assert chat["choices"][0]["token_ids"] == ids
    role, *content = chat_stream
    assert role["prompt_token_ids"] == chat_prompt
    assert all("prompt_token_ids" not in c for c in content)  # the role chunk's only (vLLM)
    assert [t for c in content for t in c["choices"][0]["token_ids"]] == ids


def test_echo_with_return_token_ids_leaves_the_prompt_text_to_the_ids(tokenizer):
    (completion,) = run(
        tokenizer, [post("completions", {"prompt": "Hi", "echo": True, "return_token_ids": True})]
    )
    assert completion["choices"][0]["text"] == tokenizer.decode([19556, 905])  # vLLM's


def test_echo_lists_each_prompt_token_first_among_its_top_logprobs(tokenizer):
    prompt = tokenizer("Once upon a time", add_special_tokens=False).input_ids
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    whole, stream = run(
        tokenizer, [post("completions", body), post("completions", {**body, "stream": True})]
    )
    ids = prompt + [19556, 905]
    logprobs = whole["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    assert logprobs["top_logprobs"][0] is None  # the first prompt token has no context
    for t, top in zip(ids[1:], logprobs["top_logprobs"][1:], strict=True):
        # the token (second most likely), then the most likely: vLLM's order
        assert list(top) == [f"token_id:{t}", f"token_id:{other(t, 0)}"]
    # a stream echoes the prompt's logprobs in its first chunk, and text_offset runs on
    streamed = [c["choices"][0]["logprobs"] for c in stream]
    assert [t for lp in streamed for t in lp["tokens"]] == logprobs["tokens"]
    assert [o for lp in streamed for o in lp["text_offset"]] == logprobs["text_offset"]
    # echo's prompt logprobs are also the choice's prompt_logprobs (vLLM's)
    assert len(whole["choices"][0]["prompt_logprobs"]) == len(prompt)


def test_return_tokens_as_token_ids_flag_and_request_field(tokenizer):
    def calls(**asked):
        return [
            post("completions", {"prompt": "Hi", "logprobs": 1, **asked}),
            post(
                "chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2, **asked}
            ),
            post(
                "chat/completions",
                {"messages": CHAT, "logprobs": True, "top_logprobs": 1, "stream": True, **asked},
            ),
        ]

    def tokens(completion, chat, chat_stream) -> list[str]:
        """Every token named in the answers' logprobs."""
        named = completion["choices"][0]["logprobs"]["tokens"]
        named += [k for top in completion["choices"][0]["logprobs"]["top_logprobs"] for k in top]
        content = chat["choices"][0]["logprobs"]["content"]
        content += [
            c for chunk in chat_stream[1:] for c in chunk["choices"][0]["logprobs"]["content"]
        ]
        named += [c["token"] for c in content] + [
            t["token"] for c in content for t in c["top_logprobs"]
        ]
        return named

    flagged = ServeOptions(return_tokens_as_token_ids=True)
    for options, asked, as_ids in (
        (flagged, {}, True),
        (None, {"return_tokens_as_token_ids": True}, True),
        (flagged, {"return_tokens_as_token_ids": False}, False),  # the request's word wins
        (None, {}, False),
    ):
        named = tokens(*run(tokenizer, calls(**asked), options=options))
        assert len(named) > 10
        assert all(t.startswith("token_id:") for t in named) == as_ids
        assert as_ids or not any(t.startswith("token_id:") for t in named)


def test_force_include_usage_puts_usage_on_every_chunk(tokenizer):
    """vLLM's test_enable_force_include_usage, for chat and completions: without
    stream_options, every chunk's usage counts what came so far, then the usage chunk."""

    async def chat(client, http):
        stream = await client.chat.completions.create(model="m", messages=CHAT, stream=True)
        return [chunk async for chunk in stream]

    async def completion(client, http):
        stream = await client.completions.create(model="m", prompt="Hi", stream=True)
        return [chunk async for chunk in stream]

    options = ServeOptions(enable_force_include_usage=True)
    for chunks in run(tokenizer, [chat, completion], options=options):
        last = 0
        for chunk in chunks:
            usage = chunk.usage
            assert usage is not None and usage.prompt_tokens > 0
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            assert last == 0 or usage.completion_tokens > last or not chunk.choices
            last = usage.completion_tokens
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    plain = run(tokenizer, [chat])[0]
    assert all(chunk.usage is None for chunk in plain)  # not asked for, not forced


def test_models_root_is_the_model_as_named(tokenizer):
    async def models(client, http):
        return (await http.get("/v1/models")).json()["data"]

    ((card,),) = run(tokenizer, [models], options=ServeOptions(model="org/name"))
    assert card["root"] == "org/name"
    assert set(card) == keys("id object created owned_by root parent max_model_len permission")
    assert card["permission"][0]["object"] == "model_permission"


def test_logprob_token_ids_is_refused_naming_it(tokenizer):
    async def chat(client, http):
        r = await http.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "logprobs": True, "logprob_token_ids": [5000]},
        )
        return r.status_code, r.json()["error"]["message"]

    ((status, message),) = run(tokenizer, [chat])
    assert status == 400 and "logprob_token_ids" in message


# ---------------------------------------------------------------- the bundled model
def test_the_openai_client_reads_vllms_fields(client, server):
    """Fields the openai SDK does not declare: absent, reading them was an AttributeError.
    With return_token_ids (vLLM's test_return_token_ids): the prompt's ids are /tokenize's,
    the generated ids decode to the text, whole or streamed."""
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert plain.choices[0].prompt_logprobs is None and plain.kv_transfer_params is None
    assert plain.choices[0].token_ids is None and plain.choices[0].prompt_token_ids is None
    asked = {"return_token_ids": True}
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=asked
    )
    choice = completion.choices[0]
    assert choice.prompt_token_ids == tokenize(server, {"prompt": prompt})
    # (the text may hold back the bytes of a character not yet complete)
    assert len(choice.token_ids) == 4 and detokenize(server, choice.token_ids).startswith(
        choice.text
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True, extra_body=asked
        )
    )
    assert chunks[0].prompt_token_ids == tokenize(server, {"messages": CHAT})
    assert not hasattr(chunks[0].choices[0], "token_ids")  # not on the role chunk (vLLM)
    streamed = [t for c in chunks[1:] if c.choices for t in c.choices[0].token_ids]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(streamed) == 4 and detokenize(server, streamed).startswith(text)
    assert client.models.list().data[0].root == DEFAULT_MODEL_NAME  # not the GGUF file


def tokenize(server, body: dict) -> list[int]:
    return keyed_post(server, "/tokenize", body).json()["tokens"]


def detokenize(server, ids: list[int]) -> str:
    return keyed_post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
