"""Property-based fuzzing of the HTTP API: /v1/completions, /v1/chat/completions, /tokenize and
/detokenize over one real engine (a tiny random-weight model, a byte-level ChatML tokenizer).

Bodies come from Hypothesis: hypothesis-jsonschema over `msgspec.json.schema` of the protocol
structs (every optional field, in and out of range), plausible values laid over them (so many
requests reach the engine), hostile field values (2^31 / 2^63 / 2^64, negatives, wrong types,
deep nesting, huge strings, NaN, unknown fields) and hostile bodies (not JSON, truncated, not an
object, a non-JSON Content-Type). Each example sends a batch of bodies at once. Properties:
  - every response is 200 or a 4xx whose body is an OpenAI error naming the problem (never a
    500, never a 503); a stream's error events too;
  - a non-JSON Content-Type (the types a web page may POST cross-site) gets a 4xx;
  - no request hangs (a per-request timeout);
  - the engine lives (/health stays 200) and after each batch holds no request and no KV block.
CI runs a fixed, derandomized set of 96 batches (768 bodies) in which every strategy below is
drawn: each route in each mode, each whole-body corruption (empty bodies as truncations), each
Content-Type, deep nesting, odd numbers, huge strings and arrays, each structured-output
constraint, and bodies the engine serves (~90 answered 200, streams among them); a set of 64
misses some.
JAXSERVE_FUZZ_EXAMPLES=N (a test knob, read only here) runs N random batches instead.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import random
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from starlette.testclient import TestClient

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.helpers import make_tiny_hf, make_tiny_tokenizer

SERVED = "fuzz-model"
VOCAB = 259  # tests/helpers.make_tiny_tokenizer's
MAX_MODEL_LEN = 128
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=64,
              num_gpu_blocks_override=48)  # fmt: skip
BATCH = 8  # bodies sent at once per example
LOCAL_EXAMPLES = os.environ.get("JAXSERVE_FUZZ_EXAMPLES")
EXAMPLES = int(LOCAL_EXAMPLES or 96)  # CI: 96 x 8 = 768 bodies
TIMEOUT_S = 60.0  # per request: far above any honest request on the tiny model
ROUTES = {
    "completions": ("/v1/completions", CompletionRequest),
    "chat": ("/v1/chat/completions", ChatCompletionRequest),
    "tokenize": ("/tokenize", TokenizeRequest),
    "detokenize": ("/detokenize", DetokenizeRequest),
}
# The Content-Types a web page may POST cross-site without a CORS preflight: never accepted.
SIMPLE_TYPES = (
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
)


# ---------------------------------------------------------------------- bodies as JSON text
class Raw(str):
    """JSON text spliced into a body as is (NaN, 1e400, nesting too deep to build as objects)."""


def encode(value: Any) -> str:
    """JSON text of value, with Raw fragments spliced in (json.dumps writes NaN / Infinity)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(encode(v) for v in value) + "]"
    return json.dumps(value)


# ---------------------------------------------------------------------- strategies
SMALL_JSON = {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "integer"},
                        {"type": "number"}, {"type": "string", "maxLength": 8}]}  # fmt: skip


def closed_schema(cls: type) -> dict:
    """msgspec's JSON schema of cls, structs closed (unknown fields come from the mutations
    below) and free-form objects and arrays kept small (so a body costs little to draw)."""
    schema = msgspec.json.schema(cls)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "object":
            if "properties" in node:
                node["additionalProperties"] = False
            else:
                node.setdefault("additionalProperties", copy.deepcopy(SMALL_JSON))
                node["maxProperties"] = 3
        if node.get("type") == "array":
            node["maxItems"] = 4
        if node.get("type") == "string":
            node["maxLength"] = 24
        for key, v in node.items():
            walk(list(v.values()) if key in ("properties", "$defs") else v)

    walk(schema)
    return schema


texts = st.text(max_size=16)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"])},
        optional={
            "content": st.one_of(
                texts,
                st.none(),
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2
                ),
            ),
            "name": texts,
        },
    ),
    min_size=1,
    max_size=3,
)
SAMPLING = dict(
    model=st.sampled_from([SERVED, None]),
    n=st.integers(1, 3),
    temperature=st.one_of(st.none(), st.floats(0, 2)),
    top_p=st.floats(0.05, 1),
    top_k=st.integers(-1, 50),
    min_p=st.floats(0, 1),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.5, 2),
    stop=st.one_of(texts.filter(bool), st.lists(texts.filter(bool), max_size=2)),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    seed=st.integers(-(2**63), 2**63 - 1),
    stream=st.booleans(),
    stream_options=st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                       "continuous_usage_stats": st.booleans()}),
    ignore_eos=st.booleans(),
    min_tokens=st.integers(0, 3),
    skip_special_tokens=st.booleans(),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100),
                               max_size=2),
    prompt_logprobs=st.integers(0, 3),
    priority=st.integers(-10, 10),
)  # fmt: skip
PLAUSIBLE = {
    "completions": dict(
        SAMPLING,
        prompt=st.one_of(texts.filter(bool), token_ids, st.lists(texts.filter(bool), min_size=1,
                         max_size=2), st.lists(token_ids, min_size=1, max_size=2)),
        max_tokens=st.one_of(st.none(), st.integers(1, 6)),
        logprobs=st.integers(0, 3),
        echo=st.booleans(),
    ),
    "chat": dict(
        SAMPLING,
        messages=messages,
        max_tokens=st.integers(1, 6),
        max_completion_tokens=st.one_of(st.none(), st.integers(1, 6)),
        logprobs=st.booleans(),
        top_logprobs=st.integers(0, 3),
        add_generation_prompt=st.booleans(),
        continue_final_message=st.booleans(),
        tool_choice=st.just("none"),
    ),
    "tokenize": dict(model=st.sampled_from([SERVED, None]), prompt=texts, messages=messages,
                     add_special_tokens=st.booleans(), add_generation_prompt=st.booleans()),
    "detokenize": dict(model=st.sampled_from([SERVED, None]), tokens=token_ids),
}  # fmt: skip
CONSTRAINTS = st.one_of(  # structured outputs: one per request
    st.sampled_from([{"response_format": {"type": "json_object"}},
                     {"response_format": {"type": "text"}},
                     {"guided_regex": "[ab]+"}, {"guided_regex": "\\d{1,3}"},
                     {"structured_outputs": {"choice": ["yes", "no"]}},
                     {"guided_json": {"type": "object",
                                      "properties": {"a": {"type": "integer"}}}}]),
    st.lists(texts.filter(bool), min_size=1, max_size=3).map(lambda c: {"guided_choice": c}),
)  # fmt: skip
REQUIRED = {"completions": "prompt", "chat": "messages", "tokenize": None, "detokenize": "tokens"}


# Uniform choices: Hypothesis leans to the first of a list and to small numbers, and repeats
# what it drew before; a random.Random seeded by several drawn numbers does neither, and is
# as reproducible.
SEEDS = st.lists(st.integers(0, 2**64 - 1), min_size=3, max_size=3).map(
    lambda seed: random.Random(repr(seed))
)


def pick(values: list) -> st.SearchStrategy:
    """One of values, uniformly (st.sampled_from leans to the first)."""
    return SEEDS.map(lambda r: r.choice(values))


def either(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    """A draw from one of strategies, chosen uniformly."""
    return SEEDS.flatmap(lambda r: r.choice(strategies))


WIDE_INTS = pick([2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                  10**30, -1, -2, -(2**31), -(2**31) - 1, -(2**63), -(2**63) - 1,
                  -(2**64)])  # fmt: skip
ODD_FLOATS = pick([1e308, -1e308, 5e-324, -0.0, 0.5, 1.5, 100.5, 1e-30])
ODD_NUMBERS = pick([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"),
                    Raw("1e-400"), Raw("01"), Raw("1.")])  # fmt: skip
ODD_STRINGS = either(
    pick(["", "0", "-1", "null", "<|im_start|>", "<|endoftext|>", "\x00", "\n" * 50,
          "\U0001f600" * 3, "{{ 7 * 7 }}", "%s%n", Raw('"\\ud800"'), Raw('"\\u0000"')]),
    pick([10**3, 10**5, 10**6]).map(lambda n: "a" * n),  # huge strings, <= 1 MB
)  # fmt: skip
SCALARS = either(WIDE_INTS, WIDE_INTS, WIDE_INTS, ODD_FLOATS, ODD_NUMBERS, ODD_STRINGS,
                 st.booleans(), st.none(), st.integers(), st.floats())  # fmt: skip
DEEP = pick([10, 100, 1000, 10_000, 100_000]).flatmap(
    lambda n: pick([Raw("[" * n + "]" * n), Raw('{"a":' * n + "1" + "}" * n)])
)
OBJECTS = either(
    st.dictionaries(st.text(max_size=4), SCALARS, min_size=1, max_size=2),
    SCALARS.map(lambda v: {"a": {"b": [v]}}),
    pick([{"2147483648": 1.0}, {"-1": 1.0}, {"0": 1e308}, {"1": Raw("NaN")}, {}]),
)
ARRAYS = either(
    st.lists(SCALARS, min_size=1, max_size=3),
    st.lists(OBJECTS, min_size=1, max_size=2),
    pick([[], [[]], [None], [{}], [[2**64]], [{"role": "user", "content": 2**64}]]),
    pick([10**4, 10**5]).map(lambda n: list(range(n))),  # huge arrays
)
BY_TYPE = {"integer": either(WIDE_INTS, WIDE_INTS, ODD_NUMBERS),
           "number": either(ODD_FLOATS, ODD_NUMBERS),
           "string": ODD_STRINGS, "object": OBJECTS, "array": ARRAYS}  # fmt: skip
ANY_HOSTILE = either(SCALARS, OBJECTS, ARRAYS, DEEP)


def hostile(types: set[str]) -> st.SearchStrategy:
    """A value hostile to a field of these JSON types: mostly of its own type (edge widths,
    odd numbers, huge or odd strings, nested oddities), else of any type, or nested deep."""
    own = [BY_TYPE[t] for t in sorted(types) if t in BY_TYPE]
    return either(*own, *own, ANY_HOSTILE) if own else ANY_HOSTILE


def field_types(cls: type) -> dict[str, set[str]]:
    """Each field of struct cls -> the JSON types its schema accepts."""
    schema = msgspec.json.schema(cls)
    props = schema["$defs"][cls.__name__]["properties"]
    return {
        name: {
            "object" if "$ref" in option else option.get("type", "object")
            for option in prop.get("anyOf", [prop])
        }
        for name, prop in props.items()
    }


UNKNOWN_FIELDS = pick(["best_of", "use_beam_search", "functions", "function_call",
                                  "truncate_prompt_tokens", "cache_salt", ""])  # fmt: skip


@dataclasses.dataclass
class Case:
    route: str
    body: bytes
    content_type: str | None
    note: str  # how the body was made, for the failure message

    def __repr__(self) -> str:
        body = (
            self.body
            if len(self.body) <= 600
            else self.body[:600] + b"...(%d bytes)" % len(self.body)
        )
        return f"POST {self.path} [{self.content_type}] ({self.note}) {body!r}"

    @property
    def path(self) -> str:
        return ROUTES[self.route][0]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    rnd = draw(SEEDS)
    route = rnd.choice(["completions"] * 3 + ["chat"] * 3 + ["tokenize", "detokenize"])
    mode = rnd.choice(["schema", "schema+plausible", "plausible", "plausible+edge"] + ["+edge"])
    mode = "plausible+edge" if mode == "+edge" else mode
    notes = [mode]
    body = draw(SCHEMAS[route]) if mode.startswith("schema") else {}
    if "plausible" in mode:
        body.update(draw(st.fixed_dictionaries({}, optional=PLAUSIBLE[route])))
        if not body.get("stream"):
            body.pop("stream_options", None)
        if route in ("completions", "chat") and rnd.random() < 0.25:
            body.update(draw(CONSTRAINTS))
        required = REQUIRED[route]
        if required and required not in body:
            body[required] = draw(PLAUSIBLE[route][required])
    fields = FIELD_TYPES[route]
    mutations = ["set"] if mode.endswith("edge") else []  # one hostile field in a valid body
    if rnd.random() < 0.3:
        mutations.append(rnd.choice(["set", "unknown", "delete"]))
    for kind in mutations:
        if kind == "delete":
            if body:
                key = rnd.choice(sorted(body))
                del body[key]
                notes.append(f"-{key}")
            continue
        key = rnd.choice(sorted(fields)) if kind == "set" else draw(UNKNOWN_FIELDS)
        body[key] = draw(hostile(fields.get(key, set())))
        notes.append(f"{key}=hostile")
    text = encode(body).encode("utf-8", "surrogatepass")
    whole = None
    if rnd.random() < 0.12:  # a body that is not one JSON object
        whole = rnd.choice(["truncated", "not json", "empty", "not object", "bytes", "bom",
                            "trailing", "bad utf-8"])  # fmt: skip
    if whole == "truncated":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif whole == "not json":
        text = rnd.choice([b"not json", b"{", b"prompt=hi&max_tokens=1", b"{'a': 1}"])
    elif whole == "empty":
        text = b""
    elif whole == "not object":
        text = rnd.choice([b"[]", b"null", b"1", b'"x"', b"true", b"[{}]"])
    elif whole == "bytes":
        text = draw(st.binary(max_size=64))
    elif whole == "bom":
        text = b"\xef\xbb\xbf" + text
    elif whole == "trailing":
        text = text + b" }garbage"
    elif whole == "bad utf-8":
        text = text[:1] + b'"\xff\xfe":1,' + text[1:] if text.startswith(b"{") else b"\xff"
    if whole:
        notes.append(whole)
    content_type = "application/json"
    if rnd.random() < 0.1:
        content_type = rnd.choice(["application/json; charset=utf-8", None, "application/xml",
                                   *SIMPLE_TYPES])  # fmt: skip
    return Case(route, text, content_type, " ".join(notes))


SCHEMAS = {route: from_schema(closed_schema(cls)) for route, (_, cls) in ROUTES.items()}
FIELD_TYPES = {route: field_types(cls) for route, (_, cls) in ROUTES.items()}


# ---------------------------------------------------------------------- the server
@dataclasses.dataclass
class Result:
    status: int | None  # None: timed out
    content_type: str
    body: bytes


class Server:
    """The app over one engine, driven in the app's own event loop (the TestClient's portal)."""

    def __init__(self, client: TestClient, engine: AsyncLLM):
        self.client, self.engine = client, engine
        self.idle = self.state()

    def send(self, batch: list[Case]) -> list[Result]:
        return self.client.portal.call(self._send_all, batch)

    async def _send_all(self, batch: list[Case]) -> list[Result]:
        transport = httpx.ASGITransport(self.client.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fuzz") as http:
            return await asyncio.gather(*(self._send(http, case) for case in batch))

    @staticmethod
    async def _send(http: httpx.AsyncClient, case: Case) -> Result:
        headers = {} if case.content_type is None else {"content-type": case.content_type}
        post = http.post(case.path, content=case.body, headers=headers)
        try:
            r = await asyncio.wait_for(post, TIMEOUT_S)
        except TimeoutError:
            return Result(None, "", b"")
        return Result(r.status_code, r.headers.get("content-type", ""), r.content)

    def health(self) -> int:
        return self.client.get("/health").status_code

    def state(self) -> dict:
        """The engine core's get_state (TimeoutError: the core no longer answers)."""

        async def get_state() -> dict:
            return await asyncio.wait_for(self.engine.call_utility("get_state"), TIMEOUT_S)

        return self.client.portal.call(get_state)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz")
    assert make_tiny_tokenizer(model) == VOCAB
    make_tiny_hf("llama", model, vocab_size=VOCAB)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model), **ENGINE))
    app = build_app(engine, [SERVED], log_stats_interval=None)
    with TestClient(app) as client:  # runs the lifespan: the engine watcher, then shutdown
        yield Server(client, engine)


# ---------------------------------------------------------------------- properties
def check_response(case: Case, r: Result) -> str | None:
    """What is wrong with the answer to case, or None."""
    if r.status == 200 and case.content_type in SIMPLE_TYPES:
        return f"a {case.content_type} body was accepted"
    if r.status != 200 and not 400 <= r.status < 500:
        return f"status {r.status}"
    if r.status != 200:
        return check_error(r.body, r.status)
    if r.content_type.startswith("text/event-stream"):
        events = [line[6:] for line in r.body.decode().split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "a stream that does not end with [DONE]"
        for event in events[:-1]:
            try:
                chunk = json.loads(event)
            except ValueError:
                return f"a stream event that is not JSON: {event[:200]!r}"
            if "error" in chunk:
                code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
                if not (isinstance(code, int) and 400 <= code < 500):
                    return f"a stream error event {event[:300]}"
        return None
    try:
        answer = json.loads(r.body)
    except ValueError:
        return "a 200 whose body is not JSON"
    key = {"completions": "choices", "chat": "choices", "tokenize": "tokens"}.get(
        case.route, "prompt"
    )
    return None if isinstance(answer, dict) and key in answer else f"a 200 without {key}"


def check_error(body: bytes, status: int) -> str | None:
    try:
        error = json.loads(body)["error"]
        ok = (isinstance(error["message"], str) and error["message"].strip()
              and isinstance(error["type"], str) and error["code"] == status)  # fmt: skip
    except (ValueError, KeyError, TypeError):
        ok = False
    return None if ok else f"status {status} without an OpenAI error body"


class EngineBroken(BaseException):
    """The engine died, leaked or hung: ends the run at once (Hypothesis shrinks only
    Exceptions, and a broken engine would fail every smaller example too)."""


@settings(
    max_examples=EXAMPLES,
    derandomize=LOCAL_EXAMPLES is None,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
@given(batch=st.lists(cases(), min_size=BATCH, max_size=BATCH))
def test_fuzz_http_api(server, batch):
    results = server.send(batch)
    hung = [case for case, r in zip(batch, results, strict=True) if r.status is None]
    if hung:
        raise EngineBroken(f"no answer within {TIMEOUT_S} s to {hung}")
    try:
        assert server.health() == 200, "/health is not 200"
        state = server.state()
    except (AssertionError, EngineDeadError, TimeoutError) as e:
        raise EngineBroken(f"the engine died ({e}) in the batch {batch}") from e
    for key in ("num_requests", "num_free_blocks"):
        if state[key] != server.idle[key]:
            raise EngineBroken(
                f"{key} is {state[key]} after the batch {batch}, idle {server.idle[key]}"
            )
    wrong = [(case, problem, r) for case, r in zip(batch, results, strict=True)
             if (problem := check_response(case, r))]  # fmt: skip
    assert not wrong, "\n".join(f"{p}: {c!r} -> {r.body[:300]!r}" for c, p, r in wrong)
