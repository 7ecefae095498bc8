"""`jaxserve serve`: the OpenAI-compatible HTTP server (one starlette app on uvicorn).

Start-up: EngineArgs from the flags -> AsyncLLM (starts the EngineCore process: load, compile,
allocate KV; blocking) -> the app -> uvicorn. The engine lives in `app.state`; every route
reads it from there. Prompts are tokenized and checked on one worker thread, off the event
loop, so a huge prompt does not stall other streams. SIGTERM / Ctrl-C: uvicorn stops accepting
connections and waits up to --shutdown-timeout for in-flight requests (then cancels them,
which aborts them in the core); the lifespan's exit then shuts the engine core down. If the
engine core dies, in-flight requests fail with its error and the server exits with status 1
(as vLLM's does), so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from jaxserve import envs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai import serving_messages
from jaxserve.entrypoints.openai.api_common import (
    PREPARE_THREADS,
    MsgspecJSONResponse,
    decode_body,
    error_response,
    generate_route,
    serving_of,
)
from jaxserve.entrypoints.openai.dev_routes import dev_routes
from jaxserve.entrypoints.openai.invocations import invocation_routes
from jaxserve.entrypoints.openai.load_tracking import load_middleware, load_routes, with_load_report
from jaxserve.entrypoints.openai.middleware import app_middleware
from jaxserve.entrypoints.openai.probes import probe_routes
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ErrorInfo,
    ErrorResponse,
)
from jaxserve.entrypoints.openai.request_body import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
)
from jaxserve.entrypoints.openai.serve_options import ServeOptions
from jaxserve.entrypoints.openai.server_setup import (  # noqa: F401 (multi_server's too)
    bind_socket,
    check_server_args,
    cors_settings,
    load_chat_template,
    ready_message,
    return_freed_memory,
    uvicorn_settings,
)
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
)
from jaxserve.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    LoRAModulePath,
    OpenAIServingModels,
    UnloadLoRAAdapterRequest,
)
from jaxserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxserve.entrypoints.openai.serving_score import OpenAIServingScore, score_routes
from jaxserve.entrypoints.openai.serving_tokenization import tokenization_routes
from jaxserve.entrypoints.openai.template_worker import shared_renderer
from jaxserve.metrics.log_line import make_log_stats
from jaxserve.metrics.prometheus import PrometheusStatLogger
from jaxserve.multimodal.media import DEFAULT_MAX_IMAGE_BYTES
from jaxserve.version import __version__

logger = logging.getLogger("jaxserve.api_server")


async def completions(request: Request) -> Response:
    s = request.app.state.serving_completion
    response = await generate_route(
        request, CompletionRequest, s.prepare_completion, s.completion, s.completion_stream
    )
    return with_load_report(request, response)  # (ORCA, when asked: load_tracking.py)


async def chat_completions(request: Request) -> Response:
    s = request.app.state.serving_chat
    response = await generate_route(
        request, ChatCompletionRequest, s.prepare_chat, s.chat, s.chat_stream, s.load_images
    )
    return with_load_report(request, response)


async def embeddings(request: Request) -> Response:
    s = request.app.state.serving_embedding
    return await generate_route(request, EmbeddingRequest, s.prepare_embedding, s.embedding, None)


async def models(request: Request) -> Response:
    s = serving_of(request)
    return MsgspecJSONResponse(s.models.model_list(s.max_model_len))


async def lora_adapters(request: Request) -> Response:
    """POST /v1/load_lora_adapter, /v1/unload_lora_adapter (with
    JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING): vLLM's plain-text success, or the error JSON."""
    models = serving_of(request).models
    try:
        if request.url.path.endswith("/load_lora_adapter"):
            body = await decode_body(request, LoadLoRAAdapterRequest)
            text = await models.load_lora_adapter(body, request.app.state.cpu)
        else:
            text = await models.unload_lora_adapter(
                await decode_body(request, UnloadLoRAAdapterRequest)
            )
    except Exception as e:
        return error_response(e)
    return PlainTextResponse(text)


async def version(request: Request) -> Response:
    return MsgspecJSONResponse({"version": __version__})


async def metrics(request: Request) -> Response:
    body = request.app.state.prometheus.exposition()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def http_error(request: Request, exc: HTTPException) -> Response:
    """404, 405 and the like as OpenAI error JSON, like every other error."""
    status, message = exc.status_code, exc.detail
    kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(status, "BadRequestError")
    if status == 404:
        message = f"{request.method} {request.url.path} does not exist"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    return MsgspecJSONResponse(ErrorResponse(ErrorInfo(message, kind, status)), status_code=status)


async def watch_engine(app: Starlette, interval: float = 0.5) -> None:
    """Once the engine core is dead: in-flight requests get its error (the output handler does
    that, or nothing was in flight), the gauges go to 0, and the server shuts down; run_server
    then exits 1."""
    engine: AsyncLLM = app.state.serving.engine
    while not engine.errored:
        await asyncio.sleep(interval)
    logger.error("the engine core died (%s): shutting the server down", engine.engine_core.dead)
    app.state.prometheus.engine_dead()
    app.state.engine_died = True
    if app.state.on_engine_death is not None:
        app.state.on_engine_death()


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    *,
    api_key: str | list[str] | None = None,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    enable_auto_tools: bool = False,
    tool_parser: str | None = None,
    enable_prompt_tokens_details: bool = False,
    log_stats_interval: float | None = 10.0,
    trust_request_chat_template: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    cors: dict[str, Any] | None = None,
    lora_modules: list[LoRAModulePath] | None = None,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    options: ServeOptions | None = None,
) -> Starlette:
    """The app over `engine`. cors: middleware.cors_middleware's settings (None: no CORS
    headers at all); lora_modules: the adapters served beside the base model (checked
    already: serving_models.check_lora_modules). With JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING,
    the routes that load and unload adapters too."""
    num_engines = engine.config.parallel.data_parallel_size
    prometheus = PrometheusStatLogger(served_model_names[0], num_engines)
    prometheus.log_cache_config(engine.config, engine.num_blocks)
    log_stats = make_log_stats(num_engines)
    engine.stat_loggers += [prometheus, log_stats]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async def periodic_log() -> None:
            while True:
                await asyncio.sleep(log_stats_interval)
                log_stats.log()

        if engine.tokenizer is not None:
            shared_renderer().start()  # the chat template process imports meanwhile
        tasks = [asyncio.create_task(watch_engine(app))]
        if log_stats_interval is not None:  # (API servers after the first: see their loads)
            tasks.append(asyncio.create_task(periodic_log()))
        try:
            await registry.load_start_up_adapters()  # bad weights: no start
            yield
        finally:
            for task in tasks:
                task.cancel()
            engine.shutdown()
            app.state.cpu.shutdown(wait=False, cancel_futures=True)
            shared_renderer().close()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", OpenAIServingResponses.create_route, methods=["POST"]),
        Route("/v1/responses/{response_id}", OpenAIServingResponses.get_route, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        *score_routes(),  # /classify, /score, /rerank, /pooling (a pooling server's)
        *probe_routes(),  # /health, /ping, /ready (probes.py)
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *tokenization_routes(),  # /tokenize, /detokenize, /tokenizer_info
        Route("/v1/messages", serving_messages.create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", serving_messages.count_tokens, methods=["POST"]),
        *load_routes(),  # /load (load_tracking.py)
        *invocation_routes(),  # SageMaker's /invocations (invocations.py)
    ]
    options = options or ServeOptions()
    if envs.JAXSERVE_SERVER_DEV_MODE:  # /sleep, /pause, weight transfer, .. (dev_routes.py)
        logger.warning("development routes on (JAXSERVE_SERVER_DEV_MODE): trusted networks only")
        routes += dev_routes(api_key)  # (none without an API key: a ValueError)
    if envs.JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING:
        logger.warning("runtime LoRA loading and unloading is on: for local development only")
        routes += [
            Route(f"/v1/{op}_lora_adapter", lora_adapters, methods=["POST"])
            for op in ("load", "unload")
        ]
    middleware = [*app_middleware(api_key, cors, options.root_path), *load_middleware(options)]
    handlers = {HTTPException: http_error}
    app = Starlette(
        routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers=handlers
    )
    registry = OpenAIServingModels(engine, served_model_names, lora_modules or ())
    details = {
        "enable_prompt_tokens_details": enable_prompt_tokens_details,
        "models": registry,
        "options": options,
    }
    app.state.serving_chat = OpenAIServingChat(
        engine,
        served_model_names,
        chat_template=chat_template,
        chat_template_content_format=chat_template_content_format,
        enable_auto_tools=enable_auto_tools,
        tool_parser=tool_parser,
        reasoning_parser=engine.config.reasoning_parser,
        max_image_bytes=max_image_bytes,
        trust_request_chat_template=trust_request_chat_template,
        **details,
    )
    app.state.serving_responses = OpenAIServingResponses(app.state.serving_chat)
    app.state.serving_completion = OpenAIServingCompletion(engine, served_model_names, **details)
    app.state.serving_embedding = OpenAIServingEmbedding(engine, served_model_names, **details)
    app.state.serving_score = OpenAIServingScore(engine, served_model_names, **details)
    app.state.serving = OpenAIServing(engine, served_model_names, **details)
    app.state.serving_messages = serving_messages.ServingMessages(app.state.serving_chat)
    app.state.cpu = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="jaxserve-tokenize")
    app.state.engine_died = False
    app.state.max_request_body_bytes = max_request_body_bytes
    app.state.on_engine_death = None  # run_server: stop uvicorn
    app.state.prometheus = prometheus
    app.state.log_stats = log_stats
    app.state.options = options
    app.state.server_load = 0  # requests in flight (--enable-server-load-tracking)
    return app


def run_server(args, engine_args, started: float | None = None) -> None:
    """One API server over its own engines (--api-server-count 1; more: multi_server.py).
    started: time.perf_counter() when the process began (the start-up timeline's zero)."""
    started = time.perf_counter() if started is None else started
    imports = time.perf_counter() - started
    sock = bind_socket(args.host, args.port)
    check_server_args(args)
    engine = AsyncLLM.from_engine_args(engine_args)
    engine.engine_core.timeline.phases.insert(0, ("frontend imports", imports))
    serve_http(args, engine, sock, started)


def serve_http(
    args, engine: AsyncLLM, sock: socket.socket, started: float, log_prefix: str = ""
) -> None:
    """Serve the app over `engine` on the bound socket until SIGTERM or the engine's death
    (then exit 1). log_prefix: before uvicorn's log lines (its access lines too)."""
    from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME

    return_freed_memory()
    api_key = args.api_key or envs.JAXSERVE_API_KEY  # (JAXSERVE_API_KEY, else VLLM_API_KEY)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    app = build_app(
        engine,
        names,
        api_key=api_key,
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        enable_auto_tools=args.enable_auto_tool_choice,
        tool_parser=args.tool_call_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        log_stats_interval=envs.JAXSERVE_LOG_STATS_INTERVAL
        if engine.engine_core.client_index == 0 and not args.disable_log_stats
        else None,
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes,
        cors=cors_settings(args),
        lora_modules=args.lora_modules,
        max_image_bytes=args.max_image_bytes,
        options=ServeOptions.from_args(args),
    )
    timeline = engine.engine_core.timeline
    logger.info("start-up: ready in %.1f s (%s)", time.perf_counter() - started, timeline.summary())
    logger.info("%s", ready_message(args, names[0], keyed=bool(api_key)))
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for formatter in log_config["formatters"].values():
        formatter["fmt"] = log_prefix + formatter["fmt"]
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        log_config=log_config,
        **uvicorn_settings(args),
    )
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it found: make
    # that a no-op, so a drained shutdown exits 0 rather than as killed by SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = uvicorn.Server(config)
    app.state.on_engine_death = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if app.state.engine_died:
        sys.exit(1)
