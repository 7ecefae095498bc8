"""OpenTelemetry request spans (--otlp-traces-endpoint, jaxserve/tracing.py): over HTTP, every
request sends one vLLM `llm_request` span to an OTLP/HTTP collector (a stub here, decoding
what the SDK's exporter posts), in the caller's trace when its headers carry a traceparent.
The app runs over AsyncLLM and tests/engine/test_request_failures.py's stand-in core (no
model, no tokenizer). A missing SDK fails at start-up naming the extra; without an endpoint
nothing of OpenTelemetry is imported."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.llm import LLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.sampling_params import SamplingParams
from jaxserve.tracing import SpanAttributes, init_tracer
from tests.engine.test_kv_transfer_params import config
from tests.engine.test_request_failures import POISON, StepCore
from tests.entrypoints.test_frontend_imports import FRONTEND
from tests.require import import_or_skip

trace_service_pb2 = import_or_skip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
STREAM_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # a streamed request's caller


class Collector:
    """An OTLP/HTTP collector stub: POST /v1/traces bodies decoded into their spans."""

    def __init__(self):
        self.spans: list = []
        self.paths: list[str] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                collector.paths.append(self.path)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        collector.spans += scope.spans
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.server.shutdown()
    c.server.server_close()


def attributes(span) -> dict:
    """A span's attributes as Python values (arrays as lists)."""
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
            if kind == "array_value"
            else getattr(v, kind)
        )
    return out


async def post_all(app, requests: list[tuple[dict, dict]]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await asyncio.gather(
            *(client.post("/v1/completions", json=b, headers=h) for b, h in requests)
        )


def test_each_request_sends_one_span_in_its_callers_trace(collector):
    """One span per request (a plain one, one in a caller's trace with n=2, a stream in
    another's and one that fails in the core) with vLLM's name, kind, start and attributes;
    the token counts equal the response's usage."""
    tracer = init_tracer(collector.url, "org/model")  # no path: /v1/traces is added
    cfg = config(max_model_len=256)
    cfg.model.vocab_size = 1000  # the stand-in core's tokens (300 + ...) and POISON + 1
    engine = AsyncLLM(cfg, StepCore(), tracer=tracer)
    app = build_app(engine, ["m"], log_stats_interval=None)
    plain = {"model": "m", "prompt": [5, 7, 0], "max_tokens": 3}
    traced = {"model": "m", "prompt": [5, 7, 8, 1], "max_tokens": 4, "n": 2,
              "temperature": 0.5, "top_p": 0.9}  # fmt: skip
    stream = {"model": "m", "prompt": [5, 7, 2], "max_tokens": 2, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    failing = {"model": "m", "prompt": [POISON + 1, 7, 3], "max_tokens": 4}
    context = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    stream_context = {"traceparent": f"00-{STREAM_TRACE_ID}-00f067aa0ba902b7-01"}
    started = time.time()
    try:
        responses = asyncio.run(
            post_all(app, [(plain, {}), (traced, context), (stream, stream_context), (failing, {})])
        )
        assert tracer.force_flush()
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)
        tracer.shutdown()
    assert [r.status_code for r in responses] == [200, 200, 200, 500]
    assert set(collector.paths) == {"/v1/traces"}
    spans = {attributes(s)[SpanAttributes.GEN_AI_REQUEST_ID]: s for s in collector.spans}
    assert len(collector.spans) == len(spans) == 4  # one per request
    events = [e.removeprefix("data: ") for e in responses[2].text.split("\n\n") if e]
    bodies = [responses[0].json(), responses[1].json(), json.loads(events[-2])]
    a = SpanAttributes
    for body, sent in zip(bodies, (plain, traced, stream), strict=True):
        span = spans[body["id"]]
        assert span.name == "llm_request"
        assert span.kind == span.SPAN_KIND_SERVER
        assert started * 1e9 <= span.start_time_unix_nano < span.end_time_unix_nano
        got = attributes(span)
        assert got[a.GEN_AI_USAGE_PROMPT_TOKENS] == body["usage"]["prompt_tokens"]
        assert got[a.GEN_AI_USAGE_COMPLETION_TOKENS] == body["usage"]["completion_tokens"]
        assert got[a.GEN_AI_USAGE_PROMPT_TOKENS] == len(sent["prompt"])
        assert got[a.GEN_AI_USAGE_COMPLETION_TOKENS] == sent["max_tokens"] * sent.get("n", 1)
        assert got[a.GEN_AI_REQUEST_MAX_TOKENS] == sent["max_tokens"]
        assert got[a.GEN_AI_REQUEST_N] == sent.get("n", 1)
        assert got[a.GEN_AI_RESPONSE_MODEL] == "org/model"
        assert got[a.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"] * sent.get("n", 1)
        ttft, e2e = got[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN], got[a.GEN_AI_LATENCY_E2E]
        assert 0 < ttft <= e2e
        assert e2e == pytest.approx(
            (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9, abs=1e-6
        )
        assert got[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] >= 0
    traced_span = attributes(spans[bodies[1]["id"]])
    assert traced_span[a.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert traced_span[a.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    # each traceparent's trace, as the caller's child; the others each start one of their own
    span = spans[bodies[1]["id"]]
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == PARENT_ID
    assert span.trace_state == "vendor=1"
    streamed = spans[bodies[2]["id"]]
    assert streamed.trace_id.hex() == STREAM_TRACE_ID
    assert streamed.parent_span_id.hex() == "00f067aa0ba902b7"
    untraced = [s for s in spans.values() if s not in (span, streamed)]
    assert all(not s.parent_span_id for s in untraced)
    assert len({s.trace_id for s in spans.values()}) == 4
    # the failed request: its span's status is the error
    (failed,) = [s for s in untraced if s is not spans[bodies[0]["id"]]]
    assert attributes(failed)[a.GEN_AI_RESPONSE_FINISH_REASONS] == ["error"]
    assert failed.status.code == failed.status.STATUS_CODE_ERROR
    assert "injected in the engine core" in failed.status.message


def test_an_llm_with_an_endpoint_sends_a_span_per_request(collector, tmp_path, monkeypatch):
    """LLM(..., otlp_traces_endpoint=...) over a tiny random model (its core in this process):
    a span per request, its model the model argument (vLLM's), its queue and prefill times
    from the core's timestamps."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # ms: each batch goes out at once
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 256, "eos_token_id": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = str(tmp_path)
    llm = LLM(model, otlp_traces_endpoint=f"{collector.url}/v1/traces", load_format="dummy",
              max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_gpu_blocks_override=16)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
        prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 11}]
        outs = llm.generate(prompts, params, use_tqdm=False)
        deadline = time.monotonic() + 10
        while len(collector.spans) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        llm.llm_engine.shutdown()
    a = SpanAttributes
    spans = {attributes(s)[a.GEN_AI_REQUEST_ID]: attributes(s) for s in collector.spans}
    assert sorted(spans) == sorted(o.request_id for o in outs)
    for out in outs:
        got = spans[out.request_id]
        assert got[a.GEN_AI_RESPONSE_MODEL] == model
        assert got[a.GEN_AI_USAGE_PROMPT_TOKENS] == len(out.prompt_token_ids)
        assert got[a.GEN_AI_USAGE_COMPLETION_TOKENS] == len(out.outputs[0].token_ids) == 3
        assert (got[a.GEN_AI_REQUEST_TEMPERATURE], got[a.GEN_AI_REQUEST_MAX_TOKENS]) == (0.0, 3)
        queue = got[a.GEN_AI_LATENCY_TIME_IN_QUEUE]
        prefill = got[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL]
        assert queue > 0 and prefill > 0
        assert queue + prefill == pytest.approx(got[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN])
        assert got[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] <= got[a.GEN_AI_LATENCY_E2E]


@pytest.mark.parametrize("start", ["LLM", "AsyncLLM"])
def test_a_missing_sdk_fails_at_start_up_naming_the_extra(start, monkeypatch, tmp_path):
    """Before anything is started (the model does not even exist)."""
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    endpoint = "http://127.0.0.1:4318/v1/traces"
    model = str(tmp_path / "no-such-model")
    with pytest.raises(ImportError, match=r"pip install 'jaxserve\[otel\]'"):
        if start == "LLM":
            LLM(model, otlp_traces_endpoint=endpoint)
        else:
            AsyncLLM.from_engine_args(EngineArgs(model=model, otlp_traces_endpoint=endpoint))


def test_an_endpoint_that_is_no_http_url_is_refused():
    with pytest.raises(ValueError, match="http://localhost:4318/v1/traces"):
        init_tracer("localhost:4317", "m")  # vLLM's gRPC form


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported():
    code = (
        "import importlib, sys\n"
        f"for name in {FRONTEND!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]"
