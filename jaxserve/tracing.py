"""OpenTelemetry request spans: vLLM's `--otlp-traces-endpoint` (vllm/tracing.py).

Each finished request becomes one span, "llm_request" (kind SERVER, from the request's arrival
to the output that finished it), with vLLM's `gen_ai.*` attribute names (SpanAttributes),
exported in batches over OTLP/HTTP (protobuf) by the OpenTelemetry SDK. A request whose HTTP
headers carry W3C trace context (traceparent / tracestate, vLLM's `trace_headers`) gets its span
in that trace, as the caller's child.

The SDK is the `otel` extra and is imported only when a tracer is made: without an endpoint
nothing of OpenTelemetry loads.
"""

from __future__ import annotations

import functools
import logging
import urllib.parse
from collections.abc import Mapping
from typing import Any

from jaxserve.outputs import RequestMetrics
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
SPAN_NAME = "llm_request"
OTEL_EXTRA = "pip install 'jaxserve[otel]'"


class SpanAttributes:
    """vLLM's attribute names (OpenTelemetry's gen-ai conventions, and vLLM's own)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # the conventions'
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of an HTTP request (None: it has none)."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


@functools.cache
def log_tracing_disabled_warning() -> None:
    """Once per process: a request carried trace context but no endpoint is set (vLLM's)."""
    logger.warning("Received a request with trace context but tracing is disabled")


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL spans are posted to: `endpoint` as given, or with `/v1/traces` when it
    names only a host (http://collector:4318). ValueError for anything but an http(s) URL."""
    url = urllib.parse.urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(
            f"--otlp-traces-endpoint {endpoint!r}: jaxserve exports over OTLP/HTTP, so it takes "
            "an http(s):// URL, e.g. http://localhost:4318/v1/traces"
        )
    return endpoint if url.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def init_tracer(otlp_traces_endpoint: str | None, model: str) -> RequestTracer | None:
    """The tracer for an engine's requests; None without an endpoint (nothing imported).
    model: the model argument, the spans' gen_ai.response.model (vLLM's)."""
    if otlp_traces_endpoint is None:
        return None
    return RequestTracer(otlp_traces_endpoint, model)


class RequestTracer:
    """Turns finished requests into spans and hands them to the SDK's batch processor, which
    exports them from its own thread (OTEL_BSP_SCHEDULE_DELAY, default 5 s, and at exit)."""

    def __init__(self, otlp_traces_endpoint: str, model: str):
        """ImportError naming the `otel` extra when the SDK is missing; ValueError for an
        endpoint that is not an http(s) URL."""
        url = traces_url(otlp_traces_endpoint)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise ImportError(
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP "
                f"exporter: {OTEL_EXTRA} ({e})"
            ) from e
        self.model = str(model)
        self.endpoint = url
        # Its own provider (not the process's global one); it flushes at interpreter exit.
        self.provider = TracerProvider()
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.tracer = self.provider.get_tracer("jaxserve.llm_engine")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER
        logger.info("OpenTelemetry: a span per request to %s", url)

    def record(
        self,
        request_id: str,
        params: SamplingParams,
        metrics: RequestMetrics,
        *,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finish_reasons: list[str],
        error: str | None,
        trace_headers: Mapping[str, str] | None,
        end_time: float,
    ) -> None:
        """One finished request's span, from its arrival to end_time (time.time()); error:
        why it failed (the span's status), None if it did not."""
        a, m = SpanAttributes, metrics
        attributes: dict[str, Any] = {
            a.GEN_AI_REQUEST_ID: request_id,
            a.GEN_AI_RESPONSE_MODEL: self.model,
            a.GEN_AI_REQUEST_N: params.n,
            a.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            a.GEN_AI_REQUEST_TOP_P: params.top_p,
            a.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
            a.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
            a.GEN_AI_USAGE_COMPLETION_TOKENS: num_generation_tokens,
            a.GEN_AI_RESPONSE_FINISH_REASONS: finish_reasons,
            a.GEN_AI_LATENCY_E2E: end_time - m.arrival_time,
            a.GEN_AI_LATENCY_TIME_IN_QUEUE: m.queue_time,
        }
        first, scheduled = m.first_token_time, m.first_scheduled_time
        if first is not None:
            last = m.last_token_time if m.last_token_time is not None else first
            attributes[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - m.arrival_time
            attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first
            if scheduled is not None:
                attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
                attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
        context = self.propagator.extract(trace_headers) if trace_headers else None
        span = self.tracer.start_span(
            SPAN_NAME,
            context=context,
            kind=self.kind,
            attributes={k: v for k, v in attributes.items() if v is not None},
            start_time=int(m.arrival_time * 1e9),
        )
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=int(end_time * 1e9))

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export every span recorded so far; False if that took longer than the timeout."""
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Flush and stop the exporter (also done at interpreter exit)."""
        self.provider.shutdown()
