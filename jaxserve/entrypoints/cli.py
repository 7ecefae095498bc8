"""The `jaxserve` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from jaxserve.entrypoints.cli_args import add_engine_args, engine_args_from
from jaxserve.entrypoints.serve_args import add_serving_flags, apply_serve_flags
from jaxserve.entrypoints.vllm_argv import normalize_argv
from jaxserve.entrypoints.vllm_flags import add_vllm_flags
from jaxserve.version import __version__

_STARTED = time.perf_counter()  # `jaxserve serve` logs its start-up time from here


def _convert(args: argparse.Namespace) -> int:
    from jaxserve.models.checkpoint import convert

    dst = convert(args.src, args.dst, dtype=args.dtype)
    print(f"wrote jaxserve checkpoint to {dst}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    apply_serve_flags(args)
    if args.headless or args.node_rank > 0:
        if not (args.headless and args.node_rank > 0):
            raise SystemExit(
                f"--node-rank {args.node_rank}{' --headless' * args.headless}: ranks above 0 run "
                "no API server and need --headless; rank 0 runs the server"
            )
        from jaxserve.worker.multihost import run_follower

        return run_follower(engine_args_from(args))
    if args.api_server_count > 1:  # this process launches the engines and the API servers
        from jaxserve.entrypoints.openai.multi_server import run_multi_api_server

        return run_multi_api_server(args, engine_args_from(args))
    from jaxserve.entrypoints.openai.api_server import run_server

    run_server(args, engine_args_from(args), started=_STARTED)
    return 0


def _proxy(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.disagg_proxy import run_proxy

    run_proxy(args.prefill, args.decode, args.host, args.port)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"jaxserve.benchmarks.{args.bench}")
    module.main(args.bench_args)
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints import run_batch

    return run_batch.run(args, engine_args_from(args))


def _collect_env(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.collect_env import main

    return main()


def _client(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.openai import cli_clients

    return cli_clients.run(args)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        usage="jaxserve serve [model] [options]",
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a hub id (ORG/NAME), HF directory, .gguf file or jaxserve checkpoint (default: "
        "the bundled SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--model", dest="model_option", default=None, help="the model, as a flag (vLLM's too)"
    )
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API answers to (default: the model argument)",
    )
    serve.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require 'Authorization: Bearer KEY' (one of these keys) on every route but the "
        "probes (or $JAXSERVE_API_KEY, $VLLM_API_KEY)",
    )
    serve.add_argument("--chat-template", default=None, help="a Jinja template or a file")
    serve.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let a request's own chat_template be rendered (off: such requests get a 400)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="larger request bodies get a 413 (default 32 MiB)",
    )
    serve.add_argument(
        "--max-image-bytes",
        type=int,
        default=20 * 1024 * 1024,
        help="a larger image in a chat message gets a 400 (default 20 MiB)",
    )
    for flag, what in (
        ("--allowed-origins", "origins allowed cross-origin requests, e.g. '[\"https://a.b\"]'"),
        ("--allowed-methods", "their methods (default with --allowed-origins: all)"),
        ("--allowed-headers", "their request headers (default with --allowed-origins: all)"),
    ):
        serve.add_argument(
            flag,
            type=json.loads,
            default=None,
            help=f"CORS, a JSON list: {what}; no CORS headers without --allowed-origins",
        )
    serve.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CORS: allow credentials (cookies)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (needs --enable-lora): name=path or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}',
    )
    serve.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="message content as the template takes it: one string, or a list of text parts "
        "(auto: detected from the template)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='tool_choice "auto": parse tool calls out of the text (needs --tool-call-parser)',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes, llama3_json, mistral, pythonic, openai, "
        "deepseek_v3, deepseek_v31, glm45, kimi_k2, minimax_m2, qwen3_coder, qwen3_xml",
    )
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens found in the prefix "
        "cache (or loaded by a KV connector)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests",
    )
    serve.add_argument(
        "--headless",
        action="store_true",
        help="a follower host of a multi-host model (--node-rank above 0): no API server",
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="HTTP server processes sharing the port, each a frontend of the same engines",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add_serving_flags(serve)
    add_engine_args(serve)
    add_vllm_flags(serve)  # the rest of vLLM's: accepted (no effect) or refused by name
    serve.set_defaults(func=_serve, background_compile=True)


def _lora_module(value: str):
    """One --lora-modules value (serving_models.parse_lora_module), an argparse error if bad."""
    from jaxserve.entrypoints.openai.serving_models import parse_lora_module

    try:
        return parse_lora_module(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_proxy_parser(sub) -> None:
    proxy = sub.add_parser(
        "proxy",
        help="disaggregated prefill/decode: send each request's prefill to a --prefill server, "
        "then the request with its kv_transfer_params to a --decode server",
    )
    for role in ("prefill", "decode"):
        proxy.add_argument(
            f"--{role}",
            action="append",
            required=True,
            metavar="URL",
            help=f"a {role} server's base URL, e.g. http://host:8100 (repeat: round robin)",
        )
    proxy.add_argument("--host", default="0.0.0.0")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.set_defaults(func=_proxy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser(
        "convert",
        help="convert a HF directory or GGUF file into a jaxserve (orbax) checkpoint",
    )
    conv.add_argument("src", help="HF model directory or .gguf file ('default': bundled model)")
    conv.add_argument("dst", help="output directory (must not hold a checkpoint already)")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    conv.set_defaults(func=_convert)
    _add_serve_parser(sub)
    _add_proxy_parser(sub)
    _add_client_parsers(sub)
    _add_run_batch_parser(sub)
    _add_collect_env_parser(sub)
    bench = sub.add_parser("bench", help="vLLM's benchmarks: latency, throughput, serve")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, what in BENCHMARKS.items():
        # Its own flags (and --help) are the benchmark's: parse_args passes them through.
        kinds.add_parser(name, help=what, add_help=False).set_defaults(func=_bench)
    return parser


BENCHMARKS = {
    "latency": "latency of one batch (vLLM's bench latency)",
    "throughput": "offline throughput of many prompts (vLLM's bench throughput)",
    "serve": "an OpenAI server under a request rate (vLLM's bench serve)",
}


def _add_client_parsers(sub) -> None:
    """`jaxserve chat` / `jaxserve complete`: vLLM's interactive clients of a running server."""
    for name, what in (("chat", "chat"), ("complete", "complete prompts")):
        p = sub.add_parser(name, help=f"{what} against a running server (stdin, line by line)")
        p.add_argument("--url", default="http://localhost:8000/v1", help="the server's /v1 URL")
        p.add_argument("--model-name", default=None, help="default: the server's first model")
        p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY, if set")
        p.add_argument("--max-tokens", type=int, default=None)
        p.add_argument(
            "-q",
            "--quick",
            default=None,
            metavar="MESSAGE",
            help="send one message, print the answer and exit",
        )
        if name == "chat":
            p.add_argument("--system-prompt", default=None)
        p.set_defaults(func=_client, command=name)


def _add_run_batch_parser(sub) -> None:
    """`jaxserve run-batch`: vLLM's, an OpenAI Batch API file through the server's routes
    (entrypoints/run_batch.py)."""
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI Batch API JSONL file (chat, completions, embeddings, score, rerank) "
        "offline, one output line per input line",
    )
    p.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="the batch, OpenAI's JSONL format: a local path (vLLM's http(s) URLs are not taken)",
    )
    p.add_argument("-o", "--output-file", required=True, help="the output JSONL: a local path")
    p.add_argument(
        "--output-tmp-dir",
        default=None,
        help="write the output here, then move it to -o once whole",
    )
    p.add_argument("--model", default=None, help="as serve's (default: the bundled model)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names a line's body may give as model (default: --model)",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja template or a file")
    p.add_argument(
        "--chat-template-content-format", default="auto", choices=["auto", "string", "openai"]
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens",
    )
    add_engine_args(p)
    p.set_defaults(func=_run_batch)


def _add_collect_env_parser(sub) -> None:
    """`jaxserve collect-env`: vLLM's, the environment a bug report needs."""
    p = sub.add_parser(
        "collect-env", help="print the versions, devices and settings a bug report needs"
    )
    p.set_defaults(func=_collect_env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # vLLM's spellings: --max_model_len, --cfg.key V, -O3, --config
        try:
            argv = normalize_argv(argv)
        except (OSError, ValueError) as e:
            parser.error(str(e))
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "func", None) is _bench:
        args.bench_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "src", None) == "default":
        args.src = None
    if getattr(args, "model_option", None) is not None:
        if args.model is not None and args.model != args.model_option:
            parser.error(f"two models: {args.model!r} and --model {args.model_option!r}")
        args.model = args.model_option
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
