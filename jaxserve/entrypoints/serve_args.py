"""`jaxserve serve`'s flags for what the HTTP server answers and how it listens, vLLM's names
and defaults: the ServeOptions flags (entrypoints/openai/serve_options.py), TLS, the root
path, access logging, the start-up's log level and hub token, and structured outputs' backend.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

logger = logging.getLogger(__name__)

# vLLM's structured-output backends: jaxserve constrains every one of their requests (JSON
# Schema, regex, choice, grammar) with llguidance, vLLM's "guidance" backend
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")
# StructuredOutputsConfig's other fields, each at the value jaxserve's behaviour has
_STRUCTURED_OUTPUT_DEFAULTS = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "reasoning_parser": "",
    "reasoning_parser_plugin": "",
    "enable_in_reasoning": False,
}


def structured_outputs_config(value: str) -> dict:
    """--structured-outputs-config: vLLM's JSON (or `.backend X` on the command line) with a
    backend jaxserve serves through llguidance and the other fields at what jaxserve does
    (reasoning_parser may name the --reasoning-parser)."""
    try:
        config = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected JSON, got {value!r}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    backend = config.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUT_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"backend {backend!r}: expected one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}"
        )
    for key, given in config.items():
        if key == "backend" or (key == "reasoning_parser" and isinstance(given, str)):
            continue
        if key not in _STRUCTURED_OUTPUT_DEFAULTS:
            raise argparse.ArgumentTypeError(f"unknown field {key!r}")
        if given != _STRUCTURED_OUTPUT_DEFAULTS[key]:
            raise argparse.ArgumentTypeError(
                f"{key}={given!r}: not supported by jaxserve (llguidance constrains with "
                f"{key}={_STRUCTURED_OUTPUT_DEFAULTS[key]!r})"
            )
    return config


def json_object(value: str) -> dict:
    """A flag's JSON object value, an argparse error naming it otherwise."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def add_serving_flags(serve: argparse.ArgumentParser) -> None:
    """The flags above, each vLLM's name, default and meaning."""
    flag = argparse.BooleanOptionalAction
    for name, what in (
        (
            "--enable-force-include-usage",
            "every streamed chunk carries usage (the counts so "
            "far) and a usage chunk ends the stream, as if each request asked for it",
        ),
        ("--return-tokens-as-token-ids", 'logprobs name tokens as "token_id:N"'),
        (
            "--enable-server-load-tracking",
            "GET /load counts the requests this server is serving (off: it answers 0, as vLLM)",
        ),
        (
            "--enable-tokenizer-info-endpoint",
            "GET /tokenizer_info: the tokenizer's settings and chat template",
        ),
        ("--disable-uvicorn-access-log", "no access log line per request"),
    ):
        serve.add_argument(name, action=flag, default=False, help=what)
    serve.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy forwards under (e.g. /llm): routes answer with and "
        "without it",
    )
    serve.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        default=None,
        metavar="JSON",
        help="chat template arguments every chat request gets under its own "
        'chat_template_kwargs, e.g. {"enable_thinking": false}',
    )
    serve.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help="comma-separated paths (e.g. /health,/metrics) with no access log line",
    )
    serve.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic throughput log line"
    )
    for name, what in (
        ("--ssl-keyfile", "serve HTTPS: the private key file"),
        ("--ssl-certfile", "serve HTTPS: the certificate file"),
        ("--ssl-ca-certs", "the CA certificates that client certificates must chain to"),
        ("--ssl-ciphers", "the TLS ciphers allowed (OpenSSL's cipher list format)"),
    ):
        serve.add_argument(name, default=None, help=what)
    serve.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)",
    )
    serve.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=4 * 2**20,
        help="the most bytes of request line and headers read before a 431 (uvicorn's h11)",
    )
    serve.add_argument(
        "--hf-token",
        nargs="?",
        const=True,
        default=None,
        help="the Hugging Face token for hub ids (default: HF_TOKEN, else huggingface-cli "
        "login's); without a value: login's",
    )
    serve.add_argument(
        "--log-level",
        type=str.upper,
        default=None,
        choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET"],
        help="jaxserve's log level (engine core processes too: JAXSERVE_LOG_LEVEL)",
    )
    serve.add_argument(
        "--structured-outputs-config",
        type=structured_outputs_config,
        default=None,
        metavar="JSON",
        help=f'e.g. {{"backend": "guidance"}}: backends {", ".join(STRUCTURED_OUTPUT_BACKENDS)} '
        "are all served by llguidance; also --structured-outputs-config.backend NAME",
    )


def apply_serve_flags(args: argparse.Namespace) -> None:
    """What the flags above set before the engine starts: the log level (this process and,
    through JAXSERVE_LOG_LEVEL, the engine core's), the hub token, the structured-output
    config's reasoning parser; and a log line naming the vLLM flags given that have no effect
    (vllm_flags.NO_OP)."""
    if args.log_level:
        logging.getLogger().setLevel(args.log_level)
        os.environ["JAXSERVE_LOG_LEVEL"] = args.log_level
    if isinstance(args.hf_token, str):
        os.environ["HF_TOKEN"] = args.hf_token
    config = args.structured_outputs_config or {}
    if config.get("reasoning_parser"):
        if args.reasoning_parser not in (None, config["reasoning_parser"]):
            raise SystemExit(
                f"--reasoning-parser {args.reasoning_parser} and --structured-outputs-config's "
                f"reasoning_parser {config['reasoning_parser']!r} differ"
            )
        args.reasoning_parser = config["reasoning_parser"]
    for flag, reason in getattr(args, "vllm_ignored_flags", None) or ():
        logger.info("%s has no effect in jaxserve: %s", flag, reason)
