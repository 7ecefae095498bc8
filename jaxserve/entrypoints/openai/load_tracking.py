"""How loaded this API server is, as vLLM tells load balancers:

- `GET /load`: `{"server_load": N}`, N the requests in flight in this API server process on
  the routes that run the model (TRACKED: generation, embeddings, pooling, scoring, the
  Messages and Responses APIs, SageMaker's /invocations), each from its start until its
  response has been sent, a stream's last event included, or its client went away. Counted
  with --enable-server-load-tracking only (`LoadTracking`, an ASGI middleware); without it
  N stays 0, as vLLM's does.
- ORCA load reports: a JSON chat or text completion whose request sends
  `endpoint-load-metrics-format: TEXT` (or `JSON`) is answered with an
  `endpoint-load-metrics` header holding the engines' waiting requests and KV-cache usage
  (`TEXT named_metrics.num_requests_waiting=2.0, named_metrics.kv_cache_usage_perc=0.4`,
  or `JSON {"named_metrics": {...}}`), with or without the flag, as vLLM's; another format
  gets no header.
"""

from __future__ import annotations

import json
import logging

from starlette._utils import get_route_path
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.entrypoints.openai.api_common import MsgspecJSONResponse
from jaxserve.entrypoints.openai.serve_options import ServeOptions

logger = logging.getLogger(__name__)

# The routes whose requests count as load (vLLM's load-aware ones that jaxserve serves)
TRACKED = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens", "/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank", "/pooling", "/invocations",
})  # fmt: skip
RESPONSES_PREFIX = "/v1/responses/"  # a stored response's retrieval (and its stream)
FORMAT_HEADER = "endpoint-load-metrics-format"
REPORT_HEADER = "endpoint-load-metrics"


class LoadTracking:
    """ASGI middleware: app.state.server_load counts the TRACKED requests in flight (pure
    ASGI, so a streamed response counts until its last byte is sent)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = get_route_path(scope) if scope["type"] == "http" else ""
        if path not in TRACKED and not path.startswith(RESPONSES_PREFIX):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load -= 1


def load_middleware(options: ServeOptions) -> list[Middleware]:
    """The app's innermost middleware (inside the API-key gate: a refused request is no
    load): LoadTracking with --enable-server-load-tracking, else none."""
    return [Middleware(LoadTracking)] if options.enable_server_load_tracking else []


async def server_load(request: Request) -> Response:
    return MsgspecJSONResponse({"server_load": request.app.state.server_load})


def with_load_report(request: Request, response: Response) -> Response:
    """`response` with vLLM's ORCA header when its request asked for one in a format vLLM
    writes (TEXT or JSON, any case) and it is a successful JSON answer (not a stream)."""
    wanted = request.headers.get(FORMAT_HEADER, "").strip().lower()
    if not wanted or response.status_code != 200 or isinstance(response, StreamingResponse):
        return response
    if wanted not in ("text", "json"):
        logger.debug("no ORCA load report in the format %r: only TEXT and JSON", wanted)
        return response
    metrics = request.app.state.prometheus.load_report()
    if wanted == "text":
        report = "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics.items())
    else:
        report = "JSON " + json.dumps({"named_metrics": metrics})
    response.headers[REPORT_HEADER] = report
    return response


def load_routes() -> list[Route]:
    """GET /load (always served: {"server_load": 0} without the flag, as vLLM's)."""
    return [Route("/load", server_load, methods=["GET"])]
