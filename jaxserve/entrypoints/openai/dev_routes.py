"""The server's development routes (JAXSERVE_SERVER_DEV_MODE=1; vLLM's VLLM_SERVER_DEV_MODE):
what an RL trainer drives between rollouts, over AsyncLLM's methods (engine/async_control.py).

  POST /sleep?level=1|2        GET /is_sleeping        POST /wake_up?tags=weights&tags=kv_cache
  POST /pause?mode=abort|wait|keep&clear_cache=true    POST /resume        GET /is_paused
  POST /init_weight_transfer_engine {"init_info": {...}}
  POST /start_weight_update {"is_checkpoint_format": true}
  POST /update_weights {"update_info": {...}}          POST /finish_weight_update
  GET /get_world_size       POST /reset_prefix_cache
  POST /collective_rpc {"method": NAME, "args": [...], "kwargs": {...}, "timeout": S}

A bad value is a 400 naming it; an engine call that raises (asleep, a missing weight, ...) is
a 400 with its message, never the engine's end.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.engine.async_control import PAUSE_MODES

logger = logging.getLogger("jaxserve.api_server")


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"{name}={value!r} is not true or false")
    return value.lower() in ("true", "1")


async def _json(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def _route(handler):
    """Run a handler over the app's engine; ValueError / RuntimeError from it or the core: a
    400 with its message."""

    async def endpoint(request: Request) -> Response:
        try:
            result = await handler(request, request.app.state.serving.engine)
        except (ValueError, RuntimeError, TypeError) as e:
            return _bad(str(e))
        return result if isinstance(result, Response) else JSONResponse(result)

    return endpoint


async def sleep(request: Request, engine) -> Any:
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise ValueError(f"level={level!r} is not 1 or 2")
    await engine.sleep(int(level))
    return Response(status_code=200)


async def wake_up(request: Request, engine) -> Any:
    await engine.wake_up(request.query_params.getlist("tags") or None)
    return Response(status_code=200)


async def is_sleeping(request: Request, engine) -> Any:
    return {"is_sleeping": await engine.is_sleeping()}


async def pause(request: Request, engine) -> Any:
    mode = request.query_params.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(PAUSE_MODES)}")
    wait = _flag(request, "wait_for_inflight_requests", False)  # vLLM's older flag
    await engine.pause_generation(
        mode, _flag(request, "clear_cache", True), wait_for_inflight_requests=wait
    )
    return {"status": "paused"}


async def resume(request: Request, engine) -> Any:
    await engine.resume_generation()
    return {"status": "resumed"}


async def is_paused(request: Request, engine) -> Any:
    return {"is_paused": await engine.is_paused()}


async def init_weight_transfer_engine(request: Request, engine) -> Any:
    body = await _json(request)
    if "init_info" not in body:
        raise ValueError("Missing 'init_info' in request body")
    await engine.init_weight_transfer_engine(body["init_info"])
    return {"message": "Weight transfer initialized"}


async def start_weight_update(request: Request, engine) -> Any:
    body = await _json(request)
    await engine.start_weight_update(bool(body.get("is_checkpoint_format", True)))
    return {"message": "Weight update started"}


async def update_weights(request: Request, engine) -> Any:
    body = await _json(request)
    if "update_info" not in body:
        raise ValueError("Missing 'update_info' in request body")
    await engine.update_weights(body["update_info"])
    return {"message": "Weights updated"}


async def finish_weight_update(request: Request, engine) -> Any:
    counts = await engine.finish_weight_update()
    return {"message": "Weight update finished", **(counts if isinstance(counts, dict) else {})}


async def get_world_size(request: Request, engine) -> Any:
    parallel = engine.config.parallel
    world = parallel.tensor_parallel_size
    if _flag(request, "include_dp", True):
        world *= parallel.data_parallel_size
    return {"world_size": world}


async def reset_prefix_cache(request: Request, engine) -> Any:
    if not await engine.reset_prefix_cache():
        raise ValueError("the prefix cache is in use by running requests: not reset")
    return Response(status_code=200)


async def collective_rpc(request: Request, engine) -> Any:
    body = await _json(request)
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise ValueError("'method' must name a model-runner method")
    args, kwargs = body.get("args") or [], body.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("'args' must be a list and 'kwargs' an object")
    timeout = body.get("timeout")
    results = await engine.collective_rpc(method, timeout, tuple(args), kwargs)
    return {"results": results}


def dev_routes() -> list[Route]:
    post, get = ["POST"], ["GET"]
    table = [
        ("/sleep", sleep, post), ("/wake_up", wake_up, post), ("/is_sleeping", is_sleeping, get),
        ("/pause", pause, post), ("/resume", resume, post), ("/is_paused", is_paused, get),
        ("/init_weight_transfer_engine", init_weight_transfer_engine, post),
        ("/start_weight_update", start_weight_update, post),
        ("/update_weights", update_weights, post),
        ("/finish_weight_update", finish_weight_update, post),
        ("/get_world_size", get_world_size, get),
        ("/reset_prefix_cache", reset_prefix_cache, post),
        ("/collective_rpc", collective_rpc, post),
    ]  # fmt: skip
    return [Route(path, _route(handler), methods=methods) for path, handler, methods in table]
