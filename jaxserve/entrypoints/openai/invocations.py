"""`POST /invocations`: Amazon SageMaker's one inference route, as vLLM serves it. The body's
shape picks the API: the first of the server's APIs, in vLLM's order, whose request the body
is, is answered by that API's own route (so the answer, a stream included, is that route's):

- a generating server: a chat completion (`messages`), then a text completion (`prompt`);
- a pooling server (--runner pooling): embeddings (an embedding model), classification (a
  classifier), rerank and score (when the model scores), then /pooling.

A body that is no JSON is a 400 "JSON decode error: ..."; one that is none of those requests
(a missing or mistyped field) a 400 naming the request types expected, as vLLM's."""

from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.entrypoints import score_utils
from jaxserve.entrypoints.openai.api_common import error_response
from jaxserve.entrypoints.openai.json_limits import BodyLimits
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    decode_request,
)
from jaxserve.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from jaxserve.entrypoints.openai.request_body import read_body

GENERATE = [(ChatCompletionRequest, "/v1/chat/completions"), (CompletionRequest, "/v1/completions")]
# A pooling model's APIs, each (task it needs, request, route): then /pooling, for any
POOLING = [
    ("embed", EmbeddingRequest, "/v1/embeddings"),
    ("classify", ClassificationRequest, "/classify"),
    ("score", RerankRequest, "/rerank"),
    ("score", ScoreRequest, "/score"),
]


def server_apis(config) -> list[tuple[type, str]]:
    """(request type, route) of each API the server of `config` (an EngineConfig) answers
    /invocations with, in the order they are tried."""
    if config.pooler is None:
        return GENERATE
    apis = []
    for task, cls, path in POOLING:
        try:
            score_utils.check_task(config, task)
        except ValueError:
            continue
        apis.append((cls, path))
    return [*apis, (PoolingRequest, "/pooling")]


def _fits(value, body: bytes, cls: type) -> bool:
    """Whether the body is a `cls` as its route will read it (lax booleans included)."""
    try:
        msgspec.convert(value, cls)
    except msgspec.ValidationError:
        try:
            decode_request(body, cls)
        except ValueError:
            return False
    return True


def _pick(body: bytes, limits: BodyLimits, apis: list[tuple[type, str]]) -> str | None:
    """The route of the first API whose request the body is (None: no API's); ValueError if
    it is no JSON or is past json_limits' bounds."""
    limits.finish(body)  # an object's structure bounded before anything is decoded
    try:
        value = msgspec.json.decode(body, type=dict)  # (anything else: refused at its start)
    except msgspec.ValidationError:  # JSON, but no object: no API's request
        return None
    except msgspec.DecodeError as e:
        raise ValueError(f"JSON decode error: {e}") from None
    return next((path for cls, path in apis if _fits(value, body, cls)), None)


async def invocations(request: Request) -> Response:
    state = request.app.state
    apis = server_apis(state.serving.engine.config)
    loop, limits = asyncio.get_running_loop(), BodyLimits()

    async def check(so_far: bytearray) -> None:  # (as api_common.decode_body reads a body)
        await loop.run_in_executor(state.cpu, limits.feed, so_far)

    try:
        body = await read_body(request, state.max_request_body_bytes, check)
        path = await loop.run_in_executor(state.cpu, _pick, body, limits, apis)
        if path is None:
            names = [cls.__name__ for cls, _ in apis]
            raise ValueError(f"Cannot find suitable handler for request. Expected one of: {names}")
    except Exception as e:
        return error_response(e)
    route = next(r for r in request.app.routes if isinstance(r, Route) and r.path == path)
    return await route.endpoint(_replay(request, body))


def _replay(request: Request, body: bytes) -> Request:
    """The request again, its body (read here already) to be read once more by the route."""
    sent = False

    async def receive():
        nonlocal sent
        if sent:  # then what the client sends (its disconnection)
            return await request.receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)


def invocation_routes() -> list[Route]:
    return [Route("/invocations", invocations, methods=["POST"])]
