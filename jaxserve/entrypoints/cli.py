"""The `jaxserve` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time

from jaxserve.version import __version__

_STARTED = time.perf_counter()  # `jaxserve serve` logs its start-up time from here


def _convert(args: argparse.Namespace) -> int:
    from jaxserve.models.checkpoint import convert

    dst = convert(args.src, args.dst, dtype=args.dtype)
    print(f"wrote jaxserve checkpoint to {dst}")
    return 0


def _serve(args: argparse.Namespace) -> int:
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


def _client(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.openai import cli_clients

    return cli_clients.run(args)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine flags, vLLM's names; each dest is the EngineArgs field of the same name
    (`engine_args_from`). The model is not among them: serve takes it as a positional
    argument, the benchmark scripts as --model."""
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory or hub id")
    parser.add_argument(
        "--revision", default=None, help="the hub model's branch, tag or commit (default: main)"
    )
    parser.add_argument("--tokenizer-revision", default=None, help="the hub tokenizer's revision")
    parser.add_argument(
        "--download-dir", default=None,
        help="the Hugging Face hub cache to read models from and download them into "
        "(default: $HF_HUB_CACHE, else ~/.cache/huggingface/hub)",
    )  # fmt: skip
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights of the model's shapes (the model may then also be a "
        "config.json or a preset such as llama-3-8b)",
    )
    parser.add_argument(
        "--hf-overrides", default=None,
        help='JSON of HF config fields set over the model\'s, e.g. {"num_hidden_layers": 2}',
    )  # fmt: skip
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "-dp", "--data-parallel-size", type=int, default=1,
        help="engine core processes, each with its own -tp devices, scheduler and KV cache; "
        "each request goes to the least loaded",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--runner", default="auto", choices=["auto", "generate", "pooling"],
        help="pooling: an embedding model (/v1/embeddings, LLM.embed) or a classifier "
        "(/classify, /score, /rerank; a *ForSequenceClassification's auto), no generation",
    )  # fmt: skip
    parser.add_argument(
        "--task", default=None, choices=["generate", "embed", "embedding", "classify", "score"],
        help="vLLM's older name: embed, classify, score = --runner pooling",
    )  # fmt: skip
    parser.add_argument(
        "--pooler-config", default=None,
        help='JSON, e.g. {"pooling_type": "MEAN", "normalize": false} (LAST, MEAN or CLS)',
    )  # fmt: skip
    parser.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="mixture of experts: whole experts per device (tensor_parallel_size of them)",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-config", default=None,
        help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    )  # fmt: skip
    parser.add_argument(
        "--kv-transfer-config", default=None,
        help='JSON, e.g. {"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}: '
        "disaggregated prefill / decode (docs/disaggregation.md)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offloading-size", type=float, default=None, metavar="GiB",
        help="host memory for KV blocks the device evicts (prefix-cache hits come back from it)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-transfer-allowed-hosts", nargs="+", default=None, metavar="HOST",
        help="hosts a request's kv_transfer_params may name as its KV's source (remote_host); "
        "list the prefill instances' kv_ip for a cross-host disaggregated setup "
        "(default: this machine only: 127.0.0.1 ::1 localhost)",
    )  # fmt: skip
    for flag, kind, default, what in (
        ("--nnodes", int, 1, "hosts one model's -tp devices span (jax.distributed)"),
        ("--node-rank", int, 0, "this host's rank; 0 runs the scheduler and the API server"),
        ("--master-addr", str, "127.0.0.1", "rank 0's address (JAX's coordinator, step calls)"),
        ("--master-port", int, 29501, "JAX's coordinator port; step calls use the next one"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=what)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype", default="auto",
        help="KV cache storage: auto (the model's dtype), bfloat16, fp8 (= fp8_e4m3) or "
        "fp8_e5m2; fp8 values are scaled by the checkpoint's k_scale / v_scale, else 1.0",
    )  # fmt: skip
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on with an accelerator, off on CPU",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        choices=["pallas", "cpu", "reference"],
        help="paged attention: the Pallas kernel (default on GPU), the C++ decode kernel for "
        "XLA:CPU (default on CPU, built on first use with g++) or the pure-jnp reference",
    )
    parser.add_argument(
        "-q",
        "--quantization",
        default=None,
        choices=[
            "int8",
            "fp8",
            "gguf",
            "compressed-tensors",
            "gptq",
            "gptq_marlin",
            "awq",
            "awq_marlin",
        ],  # fmt: skip
        help="weight-only quantization of the linear layers: int8 / fp8 computed at load, gguf "
        "(a GGUF file's blocks kept); compressed-tensors, gptq, awq (and vLLM's gptq_marlin, "
        "awq_marlin): the checkpoint's own, read from it (automatic; named, it must match)",
    )
    parser.add_argument(
        "--background-compile", action=argparse.BooleanOptionalAction, default=False,
        help="ready once the step shapes that can serve any step are compiled; the rest "
        "compile in the background (smaller prefill chunks until then; default on for serve)",
    )  # fmt: skip
    parser.add_argument(
        "--generation-config", default="auto",
        help="default sampling parameters: auto (the model's generation_config.json), vllm "
        "(none) or a directory with a generation_config.json; its max_new_tokens caps every "
        "request's output",
    )  # fmt: skip
    parser.add_argument(
        "--override-generation-config", default=None,
        help='JSON over --generation-config\'s, e.g. {"temperature": 0.5, "max_new_tokens": 256}',
    )  # fmt: skip
    parser.add_argument(
        "--enable-lora", action=argparse.BooleanOptionalAction, default=False,
        help="serve LoRA adapters: a request names one (docs/lora.md)",
    )  # fmt: skip
    parser.add_argument("--enable-prompt-embeds", action=argparse.BooleanOptionalAction,
                        default=False, help="prompts as embeddings (prompt_embeds)")  # fmt: skip
    for flag, kind, default, what in (
        ("--max-loras", int, 1, "adapters on the device at once (a step mixes at most these)"),
        ("--max-lora-rank", int, 16, "the highest adapter rank served"),
        ("--max-cpu-loras", int, None, "adapters kept in host memory (default: --max-loras)"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=what)
    parser.add_argument("--lora-dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"])  # fmt: skip
    parser.add_argument(
        "--limit-mm-per-prompt", default=None, metavar="JSON",
        help='the most images one prompt may carry, e.g. {"image": 4} (default: 999)',
    )  # fmt: skip
    parser.add_argument(
        "--allowed-local-media-path", default=None, metavar="DIR",
        help="let requests name images under DIR as file:// URLs (a security risk: trusted "
        "clients only)",
    )  # fmt: skip
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think> reasoning into the reasoning field (deepseek_r1, qwen3); "
        "structured outputs then bind after the reasoning",
    )
    return parser


def engine_args_from(args: argparse.Namespace):
    """EngineArgs from parsed flags (those of add_engine_args, plus `model`)."""
    from jaxserve.engine.arg_utils import EngineArgs

    fields = (f.name for f in dataclasses.fields(EngineArgs))
    return EngineArgs(**{name: getattr(args, name) for name in fields})


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
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
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (or $JAXSERVE_API_KEY)",
    )
    serve.add_argument("--chat-template", default=None, help="a Jinja template or a file")
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request's own chat_template be rendered (off: such requests get a 400)",
    )
    serve.add_argument(
        "--max-request-body-bytes", type=int, default=32 * 1024 * 1024,
        help="larger request bodies get a 413 (default 32 MiB)",
    )  # fmt: skip
    serve.add_argument(
        "--max-image-bytes", type=int, default=20 * 1024 * 1024,
        help="a larger image in a chat message gets a 400 (default 20 MiB)",
    )  # fmt: skip
    for flag, what in (
        ("--allowed-origins", "origins allowed cross-origin requests, e.g. '[\"https://a.b\"]'"),
        ("--allowed-methods", "their methods (default with --allowed-origins: all)"),
        ("--allowed-headers", "their request headers (default with --allowed-origins: all)"),
    ):
        serve.add_argument(
            flag, type=json.loads, default=None,
            help=f"CORS, a JSON list: {what}; no CORS headers without --allowed-origins",
        )  # fmt: skip
    serve.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)"
    )
    serve.add_argument(
        "--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
        help='LoRA adapters served by name (needs --enable-lora): name=path or JSON '
        '{"name": ..., "path": ..., "base_model_name": ...}',
    )  # fmt: skip
    serve.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="message content as the template takes it: one string, or a list of text parts "
        "(auto: detected from the template)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": parse tool calls out of the text (needs --tool-call-parser)',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes, llama3_json, mistral, pythonic",
    )
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
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
        "--headless", action="store_true",
        help="a follower host of a multi-host model (--node-rank above 0): no API server",
    )  # fmt: skip
    serve.add_argument(
        "--api-server-count", type=int, default=1,
        help="HTTP server processes sharing the port, each a frontend of the same engines",
    )  # fmt: skip
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add_engine_args(serve)
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
            f"--{role}", action="append", required=True, metavar="URL",
            help=f"a {role} server's base URL, e.g. http://host:8100 (repeat: round robin)",
        )  # fmt: skip
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
        p.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                       help="send one message, print the answer and exit")  # fmt: skip
        if name == "chat":
            p.add_argument("--system-prompt", default=None)
        p.set_defaults(func=_client, command=name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
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
