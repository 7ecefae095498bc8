"""The server's development routes (JAXSERVE_SERVER_DEV_MODE=1; vLLM's VLLM_SERVER_DEV_MODE):
what an RL trainer drives between rollouts, over AsyncLLM's methods (engine/generation_gate.py).

  POST /sleep?level=1|2        GET /is_sleeping        POST /wake_up?tags=weights&tags=kv_cache
  POST /pause?mode=abort|wait|keep&clear_cache=true    POST /resume        GET /is_paused
  POST /init_weight_transfer_engine {"init_info": {...}}
  POST /start_weight_update {"is_checkpoint_format": true}
  POST /update_weights {"update_info": {...}}          POST /finish_weight_update
  GET /get_world_size       POST /reset_prefix_cache
  POST /collective_rpc {"method": NAME, "args": [...], "kwargs": {...}, "timeout": S}

They control the whole engine and read any path it can reach, so the server serves them only
with an API key (dev_routes refuses to build them without one); the key and the JSON
Content-Type of every POST are middleware.py's. collective_rpc names one of the runner methods
engine/core_control.py's COLLECTIVE_RPC_METHODS lists.

A bad value is a 400 naming it; an engine call that raises (asleep, a missing weight, ...) is
a 400 with its message, never the engine's end; a body over --max-request-body-bytes a 413, a
collective_rpc past its timeout a 408, a dead engine a 503: all JSON {"error": message}.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.engine.generation_gate import PAUSE_MODES
from jaxserve.entrypoints.openai.json_limits import check_json_limits
from jaxserve.entrypoints.openai.request_body import RequestTooLarge, read_body

logger = logging.getLogger("jaxserve.api_server")


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"{name}={value!r} is not true or false")
    return value.lower() in ("true", "1")


async def _json(request: Request) -> dict:
    """The body as a JSON object ({} when empty), at most --max-request-body-bytes, its
    structure within json_limits' bounds before it is decoded."""
    raw = await read_body(request, request.app.state.max_request_body_bytes)
    if not raw:
        return {}
    check_json_limits(raw)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"the body is not JSON: {e}") from None
    except RecursionError:
        raise ValueError("the body is nested too deep") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def _route(handler):
    """Run a handler over the app's engine; whatever it or the core raises is a JSON error
    (module docstring), never a plain-text 500."""

    async def endpoint(request: Request) -> Response:
        try:
            result = await handler(request, request.app.state.serving.engine)
            return result if isinstance(result, Response) else JSONResponse(result)
        except RequestTooLarge as e:
            return _error(str(e), 413)
        except EngineDeadError as e:
            return _error(f"the engine core is dead: {e}", 503)
        except TimeoutError as e:  # (asyncio's too, since Python 3.11)
            return _error(str(e) or "the engine did not answer in time", 408)
        except (ValueError, RuntimeError, TypeError, OverflowError, RecursionError) as e:
            return _error(str(e))
        except Exception as e:  # a bug here: still the routes' JSON
            logger.exception("development route %s failed", request.url.path)
            return _error(f"internal error: {type(e).__name__}: {e}", 500)

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


def _timeout(value: Any) -> float | None:
    """collective_rpc's timeout: seconds (a positive finite number) or None (no limit)."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value) if abs(value) < 1e300 else math.inf  # (an int past float's range)
        if math.isfinite(seconds) and seconds > 0:
            return seconds
    raise ValueError(f"'timeout' must be a positive number of seconds or null, got {value!r}")


async def collective_rpc(request: Request, engine) -> Any:
    """One of the runner methods the core allows, by name (never a pickled function: that
    path is LLM.collective_rpc's, in the trainer's own process)."""
    body = await _json(request)
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise ValueError(f"'method' must name a model-runner method, got {method!r}")
    args, kwargs = body.get("args"), body.get("kwargs")
    args, kwargs = [] if args is None else args, {} if kwargs is None else kwargs
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError(f"'args' must be a list and 'kwargs' an object, got {args!r}, {kwargs!r}")
    timeout = _timeout(body.get("timeout"))
    try:
        results = await engine.collective_rpc(method, timeout, tuple(args), kwargs)
    except TimeoutError:
        raise TimeoutError(
            f"collective_rpc {method!r} did not finish within {timeout} s (the engine may "
            "still be running it)"
        ) from None
    return {"results": results}


def dev_routes(api_key: str | None) -> list[Route]:
    """The routes; ValueError without an API key (they would answer anyone who can reach the
    port: api_server.build_app and server_setup.check_server_args refuse to start)."""
    if not api_key:
        raise ValueError(
            "JAXSERVE_SERVER_DEV_MODE=1 needs an API key (--api-key or JAXSERVE_API_KEY): the "
            "development routes control the engine and read files it can reach"
        )
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
