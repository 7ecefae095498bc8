"""What every API route of the server shares: the JSON response, errors as each API's JSON,
reading and decoding a body off the event loop, and one generating request's course
(`generate_route`: decode, prepare, then stream or run until the client disconnects).
`api_server.py` routes the OpenAI APIs with them; the other APIs' modules do too."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxserve.entrypoints.openai.json_limits import BodyLimits
from jaxserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from jaxserve.entrypoints.openai.request_body import (
    RequestTooLarge,
    decode_json,
    read_body,
)
from jaxserve.entrypoints.openai.serving_engine import (
    DATA_PARALLEL_RANK,
    TRACE_HEADERS,
    OpenAIServing,
    error_body,
    error_status,
)
from jaxserve.entrypoints.openai.template_worker import PREPARE_TURN
from jaxserve.tracing import extract_trace_headers

logger = logging.getLogger("jaxserve.api_server")

_json = msgspec.json.Encoder()
# Threads that decode bodies and prepare requests (app.state.cpu): most wait (for a chat
# template's child, or their turn), so there are enough that a few slow renders leave room.
PREPARE_THREADS = 32


class MsgspecJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def error_response(e: BaseException) -> Response:
    if isinstance(e, RequestTooLarge):
        info = ErrorInfo(str(e), "RequestEntityTooLarge", 413)
        return MsgspecJSONResponse(ErrorResponse(info), status_code=413)
    status, _ = error_status(e)
    if status == 500:
        logger.exception("internal error", exc_info=e)
    return MsgspecJSONResponse(error_body(e), status_code=status)


def serving_of(request: Request) -> OpenAIServing:
    """What the non-generating routes use (models, tokenizer); each API has its own below."""
    return request.app.state.serving


async def off_loop(request: Request, fn, *args) -> Any:
    """fn(*args) on one of the app's PREPARE_THREADS, holding PREPARE_TURN (one at a time:
    HF tokenizers are not meant to be shared across threads) except while it waits for a
    chat template's render (template_worker.py), so a slow render holds up no one else."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app.state.cpu, PREPARE_TURN.run, fn, *args)


async def decode_body(request: Request, cls: type):
    """The body as `cls`: at most --max-request-body-bytes, its structure bounded before it
    is decoded, as it is read (request_body.py); scanned and decoded on a prepare thread,
    off the event loop, without the turn (no tokenizer). (That it is declared JSON is
    middleware.py's, for every POST.)"""
    loop, cpu, limits = asyncio.get_running_loop(), request.app.state.cpu, BodyLimits()

    async def check(so_far: bytearray) -> None:
        await loop.run_in_executor(cpu, limits.feed, so_far)

    body = await read_body(request, request.app.state.max_request_body_bytes, check)
    return await loop.run_in_executor(cpu, decode_json, body, cls, limits)


async def run_until_disconnected(request: Request, coro) -> Any:
    """Run a non-streaming handler, cancelling it (its requests are aborted in the core) as
    soon as the client disconnects."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def generate_route(
    request: Request, cls, prepare, run, stream, media=None, errors=error_response
) -> Response:
    """A generating request: body -> `cls`, prepare(body) on the tokenizer thread (and
    media(prepared): a chat's images), then stream(body, prepared) as server-sent events when
    the body asks to stream, else run(body, prepared) as JSON. errors: an exception -> the
    API's error response."""
    serving = serving_of(request)
    if serving.engine.errored:
        return errors(serving.engine.dead or serving.engine.engine_core.poll_dead())
    try:
        DATA_PARALLEL_RANK.set(data_parallel_rank(request, serving))
        TRACE_HEADERS.set(extract_trace_headers(request.headers))
        body = await decode_body(request, cls)
        prepared = await off_loop(request, prepare, body)
        prepared = prepared if media is None else await media(prepared)  # chat: its images
    except Exception as e:
        return errors(e)
    if stream is not None and body.stream:
        return StreamingResponse(stream(body, prepared), media_type="text/event-stream")
    try:
        result = await run_until_disconnected(request, run(body, prepared))
    except Exception as e:
        return errors(e)
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    return MsgspecJSONResponse(result)


def data_parallel_rank(request: Request, serving: OpenAIServing) -> int | None:
    """The X-data-parallel-rank header (vLLM's): run on that engine; ValueError if bad."""
    value = request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    size = serving.engine.config.parallel.data_parallel_size
    if not value.strip().isdigit() or int(value) >= size:
        raise ValueError(
            f"X-data-parallel-rank {value!r} is not an engine index: there are {size} "
            "data-parallel engines"
        )
    return int(value)
