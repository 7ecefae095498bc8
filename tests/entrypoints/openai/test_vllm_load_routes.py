"""What vLLM tells load balancers, dashboards and SageMaker, in process over a stand-in engine
core: GET /load (the requests in flight with --enable-server-load-tracking, 0 without), the
ORCA `endpoint-load-metrics` header of a JSON chat or text completion that asks for one, the
/metrics counts vLLM's own test_metrics.py asserts, and POST /invocations answering with the
API the body's shape names."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.invocations import server_apis
from jaxserve.entrypoints.openai.serve_options import ServeOptions
from jaxserve.ipc.messages import EngineCoreOutputs, SchedulerStats
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import FakeCore, config
from tests.engine.test_request_failures import StepCore

CHAT = {"model": "m", "messages": [{"role": "user", "content": "what is 1+1?"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's (it has a chat template)


class HoldCore(FakeCore):
    """FakeCore whose outputs wait until `release` is set (the requests stay in flight), and
    whose steps report `stats` (the scheduler's state, as a real core's do)."""

    def __init__(self, stats: SchedulerStats | None = None):
        super().__init__()
        self.release, self.stats = asyncio.Event(), stats
        self.release.set()

    def get_output(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(super().get_output().outputs, self.stats)

    async def get_output_async(self) -> EngineCoreOutputs:
        while not (self.pending and self.release.is_set()):
            await asyncio.sleep(0.001)
        return self.get_output()


def run(tokenizer, core, scenario, **app_kwargs):
    """scenario(openai client, httpx client) over an app on `core`, with the official async
    client and a plain one; its result."""
    cfg = config(max_model_len=256)
    cfg.model.vocab_size = len(tokenizer)
    engine = AsyncLLM(cfg, core, tokenizer=tokenizer)
    app = build_app(engine, ["m"], log_stats_interval=None, **app_kwargs)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="k", http_client=http, max_retries=0
            )
            return await scenario(client, http)

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)


async def in_flight(core: HoldCore, request) -> None:
    """Wait until the core holds `request`'s (a task's) work, its outputs held back."""
    for _ in range(10_000):
        if core.pending or request.done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the request never reached the core")


# ---------------------------------------------------------------------- GET /load
@pytest.mark.parametrize("tracking", [False, True])
def test_load_counts_the_requests_in_flight_until_their_stream_ends(tokenizer, tracking):
    core = HoldCore()

    async def scenario(client, http):
        loads = [(await http.get("/load")).json()]
        calls = [
            lambda: client.completions.create(model="m", prompt="hi", max_tokens=1, stream=True),
            lambda: client.chat.completions.create(**CHAT),
            lambda: http.post("/invocations", json=CHAT),
            lambda: http.post("/v1/embeddings", json={"input": "a"}),  # a 400: over at once
        ]
        for call in calls:
            core.release.clear()
            task = asyncio.create_task(call())
            await in_flight(core, task)
            loads.append((await http.get("/load")).json())
            core.release.set()
            result = await task
            if isinstance(result, openai.AsyncStream):
                assert [c async for c in result]  # read to its end
        loads.append((await http.get("/load")).json())
        return loads

    loads = run(tokenizer, core, scenario,
                options=ServeOptions(enable_server_load_tracking=tracking))  # fmt: skip
    held = [1, 1, 1, 0] if tracking else [0, 0, 0, 0]
    assert loads == [{"server_load": n} for n in [0, *held, 0]]


def test_a_refused_request_is_no_load(tokenizer):
    """A request the API-key gate refuses never reaches the counter."""

    async def scenario(client, http):
        refused = await http.post("/v1/completions", json={"prompt": "hi"})
        return refused.status_code, (await http.get("/load", headers=KEYED)).json()

    KEYED = {"authorization": "Bearer secret"}
    options = ServeOptions(enable_server_load_tracking=True)
    status, load = run(tokenizer, HoldCore(), scenario, api_key="secret", options=options)
    assert status == 401 and load == {"server_load": 0}


# ---------------------------------------------------------------------- ORCA
STATS = SchedulerStats(num_running_reqs=1, num_waiting_reqs=3, kv_cache_usage=0.25)


@pytest.mark.parametrize("tracking", [False, True])
def test_orca_header_reports_waiting_requests_and_kv_usage_when_asked(tokenizer, tracking):
    async def scenario(client, http):
        raw_chat, raw_completion = client.chat.completions, client.completions
        text = await raw_chat.with_raw_response.create(
            **CHAT, extra_headers={"endpoint-load-metrics-format": "TEXT"}
        )
        js = await raw_completion.with_raw_response.create(
            model="m", prompt="Hello", max_tokens=1,
            extra_headers={"endpoint-load-metrics-format": "json"},
        )  # fmt: skip
        unasked = await raw_chat.with_raw_response.create(**CHAT)
        unknown = await raw_chat.with_raw_response.create(
            **CHAT, extra_headers={"endpoint-load-metrics-format": "xml"}
        )
        streamed = await http.post(
            "/v1/completions", json={"prompt": "Hello", "stream": True},
            headers={"endpoint-load-metrics-format": "TEXT"},
        )  # fmt: skip
        bad = await http.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 0},
            headers={"endpoint-load-metrics-format": "TEXT"},
        )  # fmt: skip
        return [r.headers.get("endpoint-load-metrics") for r in
                (text, js, unasked, unknown, streamed, bad)]  # fmt: skip

    options = ServeOptions(enable_server_load_tracking=tracking)  # (either way, as vLLM)
    text, js, *none = run(tokenizer, HoldCore(STATS), scenario, options=options)
    assert (
        text
        == "TEXT named_metrics.num_requests_waiting=3.0, named_metrics.kv_cache_usage_perc=0.25"
    )
    kind, report = js.split(" ", 1)
    assert kind == "JSON"
    assert json.loads(report) == {
        "named_metrics": {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.25}
    }
    assert none == [None] * 4  # not asked, a format vLLM does not write, a stream, an error


# ---------------------------------------------------------------------- /metrics
class CachedCore(StepCore):
    """StepCore (a token a step until max_tokens) whose requests each report 4 prompt tokens
    found in the prefix cache and one preemption, as a real core's outputs carry them."""

    def get_output(self) -> EngineCoreOutputs:
        outputs = super().get_output()
        for out in outputs.outputs:
            out.num_cached_tokens, out.num_preemptions = 4, 1
        return outputs


def test_metrics_count_what_vllms_test_metrics_counts(tokenizer):
    """vLLM's test_metrics_counts, over N requests of P prompt tokens (4 of them cached) and
    M generated: one iteration_tokens observation per step, its sum the tokens computed."""
    from prometheus_client.parser import text_string_to_metric_families

    n, p, m = 3, 7, 4

    async def scenario(client, http):
        for _ in range(n):
            await client.completions.create(model="m", prompt=list(range(400, 400 + p)),
                                            max_tokens=m)  # fmt: skip
        return (await http.get("/metrics")).text

    text = run(tokenizer, CachedCore(), scenario)
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.labels.get("finished_reason") in (None, "length")}  # fmt: skip
    expected = {
        "vllm:iteration_tokens_total_sum": n * (p - 4 + m),
        "vllm:iteration_tokens_total_count": n * m,
        "vllm:request_params_n_count": n,
        "vllm:request_params_n_sum": n,
        "vllm:request_params_max_tokens_sum": n * m,
        "vllm:request_params_max_tokens_count": n,
        "vllm:request_num_preemptions_count": n,
        "vllm:request_num_preemptions_sum": n,
        "vllm:prompt_tokens_total": n * p,
        "vllm:generation_tokens_total": n * m,
        "vllm:request_success_total": n,
        "vllm:admission_rejections_total": 0,
    }
    assert {k: got.get(k) for k in expected} == expected
    for name in ("vllm:num_requests_waiting_by_reason", "vllm:cache_config_info"):
        assert f"# TYPE {name} gauge" in text


# ---------------------------------------------------------------------- POST /invocations
def test_invocations_answers_with_the_api_the_body_names(tokenizer):
    completion = {"model": "m", "prompt": "Hello", "max_tokens": 1}

    async def scenario(client, http):
        return [
            await http.post("/v1/chat/completions", json=CHAT),
            await http.post("/invocations", json=CHAT),
            await http.post("/invocations", json=completion),
            await http.post("/invocations", json={**CHAT, "stream": True}),
            await http.post(
                "/invocations", json=CHAT, headers={"endpoint-load-metrics-format": "TEXT"}
            ),
        ]

    chat, invoked, text, streamed, reported = run(tokenizer, HoldCore(), scenario)
    assert chat.status_code == invoked.status_code == 200, invoked.text
    assert invoked.json().keys() == chat.json().keys()  # (vLLM's test_invocations)
    assert invoked.json()["object"] == "chat.completion"
    assert invoked.json()["choices"] == chat.json()["choices"]
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert reported.headers["endpoint-load-metrics"].startswith("TEXT named_metrics.")


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "JSON decode error: "),
        (b"[1, 2]", "Cannot find suitable handler for request. Expected one of: "
                    "['ChatCompletionRequest', 'CompletionRequest']"),
        (b'"hello"', "Cannot find suitable handler for request."),
        (b"[" * 5000 + b"]" * 5000, "Cannot find suitable handler"),  # never decoded
        (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "a: the JSON is nested more than 64"),
    ],
)  # fmt: skip
def test_invocations_refuses_a_body_that_is_no_request(tokenizer, body, message):
    async def scenario(client, http):
        headers = {"content-type": "application/json"}
        return await http.post("/invocations", content=body, headers=headers)

    response = run(tokenizer, HoldCore(), scenario)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def pooling_config(architecture: str, labels: int = 0):
    cfg = config()
    cfg.pooler = object()  # a pooling server (--runner pooling)
    cfg.model.architecture = architecture
    cfg.model.hf_config = SimpleNamespace(id2label={i: str(i) for i in range(labels)})
    return cfg


@pytest.mark.parametrize(
    "cfg, apis",
    [
        (config(), ["ChatCompletionRequest", "CompletionRequest"]),
        (pooling_config("BertModel"),
         ["EmbeddingRequest", "RerankRequest", "ScoreRequest", "PoolingRequest"]),
        (pooling_config("BertForSequenceClassification", labels=1),
         ["ClassificationRequest", "RerankRequest", "ScoreRequest", "PoolingRequest"]),
        (pooling_config("BertForSequenceClassification", labels=3),
         ["ClassificationRequest", "PoolingRequest"]),
    ],
)  # fmt: skip
def test_invocations_tries_the_servers_apis_in_vllms_order(cfg, apis):
    assert [cls.__name__ for cls, _ in server_apis(cfg)] == apis
