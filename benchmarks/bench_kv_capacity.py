"""KV capacity with and without KV-cache groups (jaxserve/benchmarks/kv_capacity.py): how many
32k-token sequences a 40 GiB KV budget holds for models that mix windowed and full layers,
from the allocator on the presets' real widths (bf16 cache, tp 1, blocks of 16, prompts in
chunks of 8192). No weights, no device: the numbers are the same on any machine.

    .venv/bin/python benchmarks/bench_kv_capacity.py --output-json \\
        benchmarks/results/kv-capacity-2026-12-05.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from jaxserve.benchmarks.kv_capacity import capacity
from jaxserve.transformers_utils.config import read_model_config
from jaxserve.transformers_utils.model_path import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=[
            "gemma-3-27b",
            "gpt-oss-120b",
            "llama-4-scout",
            "gemma-4-31b",
            "gemma-4-26b-a4b",
            "gemma-4-e4b",
        ],
    )
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    rows = {}
    for name in args.models:
        config = read_model_config(resolve_model_path(name, "dummy"), "bfloat16")
        before = capacity(config, budget, args.seq_len, one_group=True)
        after = capacity(config, budget, args.seq_len)
        rows[name] = {
            "before": dataclasses.asdict(before),
            "after": dataclasses.asdict(after),
            "gain": round(after.sequences / max(before.sequences, 1), 2),
        }
        print(f"{name}: {before.sequences} -> {after.sequences} sequences ({after.layout})")
    result = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "budget_gib": args.budget_gib,
        "seq_len": args.seq_len,
        "models": rows,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
