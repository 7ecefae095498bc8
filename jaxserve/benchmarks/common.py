"""Helpers the benchmark scripts share: prompts, the decode-step estimate, the roofline, JSON."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def benchmark_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of `jaxserve bench NAME`, its module docstring as the description."""
    return argparse.ArgumentParser(
        prog=f"jaxserve bench {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_benchmark_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags bench_latency and bench_throughput share (vLLM's names), engine flags last."""
    from jaxserve.entrypoints.cli_args import add_engine_args

    parser.add_argument(
        "--backend",
        choices=["jaxserve", "hf", "vllm"],
        default="jaxserve",
        help="vllm: vLLM's CPU build in its own venv ($JAXSERVE_VLLM_PYTHON, default "
        ".venv-vllm/bin/python); needs an HF model directory",
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--output-json", default=None, help="save the results here")
    parser.add_argument(
        "--no-roofline", action="store_true", help="skip the one-token run(s) and the roofline"
    )
    return add_engine_args(parser)


def random_prompt_ids(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """num prompts of `length` random token ids, clear of the low ids where special tokens
    usually sit (when the vocabulary is large enough to have a choice)."""
    low = 100 if vocab_size > 1000 else 0
    rng = np.random.default_rng(seed)
    return rng.integers(low, min(vocab_size, 20000), (num, length)).tolist()


def decode_step_seconds(latency_s: float, prefill_s: float, output_len: int) -> float | None:
    """One decode step, from a run of output_len tokens and one of a single token (the prefill
    and first sample, plus fixed per-request costs): the rest is output_len - 1 decode steps."""
    if output_len < 2:
        return None
    return (latency_s - prefill_s) / (output_len - 1)


def roofline_report(
    config: ModelConfig, step_s: float, num_seqs: int, input_len: int, output_len: int
):
    """The Roofline of a decode step of num_seqs sequences, at their mean context length over
    the output (input_len + output_len / 2: the KV read grows linearly, so the mean is exact).
    Runs on this process's first jax device: call it after the engine under test has gone."""
    from jaxserve.benchmarks.roofline import Roofline, decode_step_cost, device_peaks

    cost = decode_step_cost(config, [input_len + output_len / 2] * num_seqs)
    return Roofline(step_s, cost, device_peaks(config.dtype))


def print_roofline(roofline) -> None:
    print(roofline.line())
    print(roofline.detail())


def median_seconds(fn, *args, warmup: int = 1, iters: int) -> float:
    """Median wall time of fn(*args) over iters calls after warmup calls, each synchronised
    with jax.block_until_ready (device work is asynchronous)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> str:
    return f"{platform.machine()} {platform.processor()}".strip()


def write_json(path: str | Path, results: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
        f.write("\n")
