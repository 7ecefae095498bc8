"""The server's probes, for load balancers, Docker's HEALTHCHECK and Kubernetes:

- `GET /health`: 200 while the engine lives, 503 once it is dead (vLLM's).
- `GET|POST /ping`: the same (vLLM's alias of /health, which SageMaker calls).
- `GET /ready`: 200 while the engine lives and generates, 503 once it is dead or while it is
  paused or asleep (JAXSERVE_SERVER_DEV_MODE's /pause, /sleep), with how far compilation has
  gone: `{"ready": true, "fully_compiled": bool, "compiled": n, "total": m}`. The app only
  answers once the engine core is READY (it serves any step from then on), so ready is true
  as soon as routes answer; with background compilation (`jaxserve serve`'s default) the other
  step shapes are still compiling then, and steps pad to the shapes that are ready.
- `GET /ready?compiled=true`: 200 only once every engine has compiled every step shape, 503
  before (and on a dead engine): for a probe that must not send traffic until the server runs
  at full speed.

The counts come from the engine cores' `compile_status` utility call. Probes come every few
seconds, from several probers: one call at a time serves them all, its answer is kept for
COMPILE_STATUS_TTL_S, and once every engine is fully compiled it is kept for good (compiled
shapes stay compiled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_common import MsgspecJSONResponse, serving_of

logger = logging.getLogger("jaxserve.api_server")

COMPILE_STATUS_TTL_S = 1.0  # how long an answer of compile_status is reused
COMPILE_STATUS_TIMEOUT_S = 5.0  # a probe never waits longer on the engine cores
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no", "")


def summarize(result: Any) -> dict:
    """compile_status of one engine, or of several as `core_client.combine_results` merges
    them (the counts as lists, the flag or-ed, every engine's dict under "engines"): the
    counts summed, fully compiled only when every engine is, and with several engines each
    one's status under "engines"."""
    engines = result.get("engines", [result])
    status = {
        "compiled": sum(e["compiled"] for e in engines),
        "total": sum(e["total"] for e in engines),
        "fully_compiled": all(e["fully_compiled"] for e in engines),
    }
    if len(engines) > 1:
        status["engines"] = [{k: e[k] for k in status} for e in engines]
    return status


class CompileStatus:
    """The engines' compile status, asked at most once per `ttl` seconds (concurrent probes
    await the one call) and never again once every engine is fully compiled."""

    def __init__(self, engine: AsyncLLM, ttl: float = COMPILE_STATUS_TTL_S):
        self.engine, self.ttl = engine, ttl
        self.last: dict | None = None  # the last answer (summarize's)
        self.at = float("-inf")  # time.monotonic() of it
        self.pending: asyncio.Future | None = None  # the call under way

    def fresh(self) -> bool:
        return self.last is not None and (
            self.last["fully_compiled"] or time.monotonic() - self.at < self.ttl
        )

    async def get(self) -> dict | None:
        """The status (None: the engines did not answer, and none is known)."""
        if self.fresh():
            return self.last
        if self.pending is None or self.pending.done():
            self.pending = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self.pending)  # (a probe that goes away stops no call)

    async def _ask(self) -> dict | None:
        try:
            result = await asyncio.wait_for(
                self.engine.call_utility("compile_status"), COMPILE_STATUS_TIMEOUT_S
            )
        except Exception as e:  # a probe answers all the same; the error is logged
            if not self.engine.errored:
                logger.warning("/ready: compile_status failed: %r", e)
            return self.last
        self.last, self.at = summarize(result), time.monotonic()
        return self.last


def compile_status(request: Request) -> CompileStatus:
    """The app's CompileStatus (made by the first probe that needs it)."""
    state = request.app.state
    if getattr(state, "compile_status", None) is None:
        state.compile_status = CompileStatus(serving_of(request).engine)
    return state.compile_status


async def health(request: Request) -> Response:
    """GET /health, GET|POST /ping."""
    return Response(status_code=503 if serving_of(request).engine.errored else 200)


async def ready(request: Request) -> Response:
    """GET /ready, GET /ready?compiled=true."""
    flag = request.query_params.get("compiled", "").strip().lower()
    if flag not in TRUE + FALSE:  # (a typo must not turn the probe into plain readiness)
        body = {"error": f"compiled={flag!r}: use compiled=true or compiled=false"}
        return MsgspecJSONResponse(body, status_code=400)
    cache = compile_status(request)
    alive = not serving_of(request).engine.errored
    status = await cache.get() if alive else cache.last  # a dead engine is not asked
    alive = alive and not serving_of(request).engine.errored  # (it may have died meanwhile)
    # paused or asleep (the dev routes, engine/generation_gate.py): requests would only wait
    paused = await serving_of(request).engine.is_paused()
    fully = bool(status and status["fully_compiled"])
    body = {
        "ready": alive and not paused,
        "paused": paused,
        "fully_compiled": fully,
        "compiled": status["compiled"] if status else None,
        "total": status["total"] if status else None,
    }
    if status and "engines" in status:
        body["engines"] = status["engines"]
    ok = alive and not paused and (fully or flag in FALSE)
    return MsgspecJSONResponse(body, status_code=200 if ok else 503)


def probe_routes() -> list[Route]:
    """The routes api_server.build_app serves the probes on."""
    return [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/ready", ready, methods=["GET"]),
    ]
