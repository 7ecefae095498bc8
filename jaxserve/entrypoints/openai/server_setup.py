"""`jaxserve serve`'s start-up around the app: checking the flags before minutes of loading,
binding the socket, the settings the flags give the app, and the "try: curl ..." log line."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from typing import Any

import msgspec

from jaxserve import envs
from jaxserve.config import MultiModalConfig
from jaxserve.entrypoints.openai.dev_routes import dev_routes

_json = msgspec.json.Encoder()
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
FREED_MAPPING_BYTES = 128 * 1024  # glibc's initial threshold, kept


def return_freed_memory() -> bool:
    """Keeps glibc's mmap threshold at 128 KiB in this process, so that every allocation that
    large is a mapping of its own, given back to the system when freed. By default glibc
    raises the threshold after a large block is freed (up to 32 MiB), and a request's large
    temporaries (its body, a decoded image, a response's JSON) then stay in the heap after
    it ends: a 32 MiB Responses store filled with 2.9 MB bodies grew the process 43.6 MiB
    under glibc's default, 31.4 MiB with this (benchmarks/results/hardening-cpu-2026-12-04).
    False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, FREED_MAPPING_BYTES))


def load_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the template itself."""
    if value is not None and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def check_server_args(args) -> None:
    """Flag errors before minutes of loading: parser names, auto tools without a parser,
    --default-chat-template-kwargs, the body and image limits, --limit-mm-per-prompt and
    --allowed-local-media-path, CORS lists, the --lora-modules adapters, an API key for
    JAXSERVE_SERVER_DEV_MODE."""
    if args.api_server_count < 1:
        raise SystemExit(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    if args.max_request_body_bytes < 1:
        raise SystemExit(
            f"--max-request-body-bytes must be positive, got {args.max_request_body_bytes}"
        )
    if args.max_image_bytes < 1:
        raise SystemExit(f"--max-image-bytes must be positive, got {args.max_image_bytes}")
    try:
        MultiModalConfig.parse(
            args.limit_mm_per_prompt, args.allowed_local_media_path, args.allowed_media_domains
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, flag)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            name = "--" + flag.replace("_", "-")
            raise SystemExit(f'{name} must be a JSON list of strings, e.g. ["x"]: got {value!r}')
    check_lora_args(args)
    if envs.JAXSERVE_SERVER_DEV_MODE:
        try:  # (build_app refuses too; here before minutes of loading)
            dev_routes(args.api_key or envs.JAXSERVE_API_KEY)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    try:
        if args.tool_call_parser:
            from jaxserve.entrypoints.openai.tool_parsers import ToolParserManager

            ToolParserManager.get_tool_parser(args.tool_call_parser)
        if args.reasoning_parser:
            from jaxserve.reasoning import ReasoningParserManager

            ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
    except (KeyError, ValueError) as e:
        raise SystemExit(str(e)) from None
    defaults = getattr(args, "default_chat_template_kwargs", None)
    if defaults:  # (the tokenizer's special tokens are checked when the app is built)
        from jaxserve.entrypoints.openai.chat_utils import check_template_kwargs

        try:
            check_template_kwargs(defaults, [])
        except ValueError as e:
            raise SystemExit(f"--default-chat-template-kwargs: {e}") from None


def check_lora_args(args) -> None:
    """Each --lora-modules adapter readable and served by this engine (rank at most
    --max-lora-rank, ...), names unique; runtime adapter updates refused with several API
    servers (each has its own registry: a load would reach one of them)."""
    if envs.JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING and args.api_server_count > 1:
        raise SystemExit(
            "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING cannot be used with --api-server-count "
            f"{args.api_server_count}: each API server has its own adapters, so a load would "
            "reach one of them; serve the adapters with --lora-modules instead"
        )
    if not args.lora_modules:
        return
    from jaxserve.entrypoints.openai.serving_models import check_lora_modules
    from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME

    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    try:
        check_lora_modules(args.lora_modules, names, args.max_lora_rank)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before minutes of loading and compiling (a taken port fails
    now); several API-server processes share it (--api-server-count)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def cors_settings(args) -> dict[str, Any] | None:
    """--allowed-origins & co. for middleware.cors_middleware; None unless origins are given."""
    if not args.allowed_origins:
        return None
    return {
        "allow_origins": args.allowed_origins,
        "allow_methods": args.allowed_methods,
        "allow_headers": args.allowed_headers,
        "allow_credentials": args.allow_credentials,
    }


def uvicorn_settings(args) -> dict[str, Any]:
    """uvicorn.Config's settings from vLLM's flags: TLS (--ssl-*), the access log
    (--disable-uvicorn-access-log, --disable-access-log-for-endpoints) and h11's limit on a
    request's head (--h11-max-incomplete-event-size)."""
    settings: dict[str, Any] = {
        "access_log": not args.disable_uvicorn_access_log,
        "h11_max_incomplete_event_size": args.h11_max_incomplete_event_size,
    }
    if args.ssl_keyfile or args.ssl_certfile:
        settings.update(
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
        if args.ssl_ciphers:
            settings["ssl_ciphers"] = args.ssl_ciphers
    if args.disable_access_log_for_endpoints:
        quiet = {p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p.strip()}
        logging.getLogger("uvicorn.access").addFilter(
            lambda record: not (len(record.args or ()) > 2 and record.args[2] in quiet)
        )
    return settings


def ready_message(args, model: str, *, keyed: bool) -> str:
    """The start-up log's "serving ... try: curl ..." line. With an API key the example
    carries a placeholder, never the key (logs are read by more people than hold it)."""
    host = "localhost" if args.host in ("0.0.0.0", "::", "") else args.host
    key = "$JAXSERVE_API_KEY" if args.api_key is None else "<your --api-key>"
    auth = f' -H "Authorization: Bearer {key}"' if keyed else ""
    body = _json.encode(
        {
            "model": model,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
    ).decode()
    return (
        f"serving {model} on http://{args.host}:{args.port}; try:\n  curl "
        f"http://{host}:{args.port}/v1/chat/completions -H 'Content-Type: application/json'"
        f"{auth} -d '{body}'"
    )
