"""The engine's command-line flags (vLLM's names), shared by `jaxserve serve`, `jaxserve bench`
and the benchmark scripts: `add_engine_args` adds them, `engine_args_from` reads them back."""

from __future__ import annotations

import argparse
import dataclasses

_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names


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
        "--tokenizer-mode",
        default="auto",
        help="auto / hf: the tokenizer's chat template; deepseek_v32: DeepSeek-V3.2's prompt "
        "encoding (the model ships no template)",
    )
    parser.add_argument(
        "--download-dir",
        default=None,
        help="the Hugging Face hub cache to read models from and download them into "
        "(default: $HF_HUB_CACHE, else ~/.cache/huggingface/hub)",
    )
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights of the model's shapes (the model may then also be a "
        "config.json or a preset such as llama-3-8b)",
    )
    parser.add_argument(
        "--hf-overrides",
        default=None,
        help='JSON of HF config fields set over the model\'s, e.g. {"num_hidden_layers": 2}',
    )
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages (JAXSERVE_PP_LAYER_PARTITION)",
    )
    parser.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine core processes, each with its own -tp devices, scheduler and KV cache; "
        "each request goes to the least loaded",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        type=lambda v: _DTYPE_ALIASES.get(v, v),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the weights' and activations' dtype (vLLM's half = float16, float = float32)",
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
        "--disable-hybrid-kv-cache-manager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="one KV-cache group of every layer: sliding-window and chunked layers keep the "
        "whole context (by default each attention kind has its own blocks)",
    )
    parser.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="pooling: an embedding model (/v1/embeddings, LLM.embed) or a classifier "
        "(/classify, /score, /rerank; a *ForSequenceClassification's auto), no generation",
    )
    parser.add_argument(
        "--task",
        default=None,
        choices=["generate", "embed", "embedding", "classify", "score"],
        help="vLLM's older name: embed, classify, score = --runner pooling",
    )
    parser.add_argument(
        "--pooler-config",
        default=None,
        help='JSON, e.g. {"pooling_type": "MEAN", "normalize": false} (LAST, MEAN or CLS)',
    )
    parser.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="mixture of experts: whole experts per device (tensor_parallel_size of them)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    )
    parser.add_argument(
        "--kv-transfer-config",
        default=None,
        help='JSON, e.g. {"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}: '
        "disaggregated prefill / decode (docs/disaggregation.md)",
    )
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GiB",
        help="host memory for KV blocks the device evicts (prefix-cache hits come back from it)",
    )
    parser.add_argument(
        "--kv-transfer-allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="hosts a request's kv_transfer_params may name as its KV's source (remote_host); "
        "list the prefill instances' kv_ip for a cross-host disaggregated setup "
        "(default: this machine only: 127.0.0.1 ::1 localhost)",
    )
    for flag, kind, default, what in (
        ("--nnodes", int, 1, "hosts one model's -tp x -pp devices span (jax.distributed)"),
        ("--node-rank", int, 0, "this host's rank; 0 runs the scheduler and the API server"),
        ("--master-addr", str, "127.0.0.1", "rank 0's address (JAX's coordinator, step calls)"),
        ("--master-port", int, 29501, "JAX's coordinator port; step calls use the next one"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=what)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache storage: auto (the model's dtype), bfloat16, fp8 (= fp8_e4m3) or "
        "fp8_e5m2; fp8 values are scaled by the checkpoint's k_scale / v_scale, else 1.0",
    )
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
            "mxfp4",
            "int4",
            "fp8_block",
        ],
        help="weight-only quantization of the linear layers: int8 / fp8 computed at load, gguf "
        "(a GGUF file's blocks kept); compressed-tensors, gptq, awq (and vLLM's gptq_marlin, "
        "awq_marlin), mxfp4 (gpt-oss's experts): the checkpoint's own, read from it "
        "(automatic; named, it must match). With --load-format dummy, mxfp4 / int4 / "
        "fp8_block: random weights packed as that format's checkpoints keep them, experts "
        "included",
    )
    parser.add_argument(
        "--background-compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="ready once the step shapes that can serve any step are compiled; the rest "
        "compile in the background (smaller prefill chunks until then; default on for serve)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling parameters: auto (the model's generation_config.json), vllm "
        "(none) or a directory with a generation_config.json; its max_new_tokens caps every "
        "request's output",
    )
    parser.add_argument(
        "--override-generation-config",
        default=None,
        help='JSON over --generation-config\'s, e.g. {"temperature": 0.5, "max_new_tokens": 256}',
    )
    parser.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters: a request names one (docs/lora.md)",
    )
    parser.add_argument(
        "--enable-prompt-embeds",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prompts as embeddings (prompt_embeds)",
    )
    parser.add_argument(
        "--enable-sleep-mode",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="allow sleep / wake_up (frees memory)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send OpenTelemetry request spans there (the otel extra)",
    )
    for flag, kind, default, what in (
        ("--max-loras", int, 1, "adapters on the device at once (a step mixes at most these)"),
        ("--max-lora-rank", int, 16, "the highest adapter rank served"),
        ("--max-cpu-loras", int, None, "adapters kept in host memory (default: --max-loras)"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=what)
    parser.add_argument(
        "--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help='the most images one prompt may carry, e.g. {"image": 4} (default: 999)',
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="let requests name images under DIR as file:// URLs (a security risk: trusted "
        "clients only)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="the only hosts http(s) image URLs may name, on every redirect (default: any "
        "public host)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think> reasoning into the reasoning field (deepseek_r1, deepseek_v3, glm45, "
        "kimi_k2, minimax_m2, minimax_m2_append_think, qwen3, openai_gptoss); "
        "structured outputs then bind after the reasoning",
    )
    return parser


def engine_args_from(args: argparse.Namespace):
    """EngineArgs from parsed flags (those of add_engine_args, plus `model`)."""
    from jaxserve.engine.arg_utils import EngineArgs

    fields = (f.name for f in dataclasses.fields(EngineArgs))
    return EngineArgs(**{name: getattr(args, name) for name in fields})
