"""Prefix caching on a hybrid model (core/state_cache.py): time to first token of a prompt
whose ~2k-token prefix was seen before (its linear-attention state restored, its blocks hit)
against a cold prompt of the same length, in one engine, alternated, medians.

The model is the qwen3-next-80b preset's widths with dummy weights, cut down by
--hf-overrides to fit the machine (default: 8 layers; on a 23 GiB CPU machine also 64 of its
512 experts, or its weights alone would not fit).

    .venv/bin/python benchmarks/bench_hybrid_prefix.py --output-json \\
        benchmarks/results/hybrid-prefix-cache-cpu-2026-12-05.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

os.environ.setdefault("JAXSERVE_ENABLE_MULTIPROCESSING", "0")  # the core in this process

import numpy as np  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-next-80b")
    parser.add_argument("--hf-overrides", default='{"num_hidden_layers": 8, "num_experts": 64}')
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", hf_overrides=json.loads(args.hf_overrides),
              max_model_len=args.prefix_len + 64, max_num_seqs=4,
              max_num_batched_tokens=512)  # fmt: skip
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
        return time.perf_counter() - start, out.num_cached_tokens

    ttft(rng.integers(1, 1000, args.prefix_len + 8).tolist())  # warm-up
    cold, warm = [], []
    for _ in range(args.rounds):
        prefix = rng.integers(1, 1000, args.prefix_len).tolist()
        seconds, cached = ttft(prefix + rng.integers(1, 1000, 8).tolist())
        cold.append((seconds, cached))
        seconds, cached = ttft(prefix + rng.integers(1, 1000, 8).tolist())
        warm.append((seconds, cached))
    result = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "prompt_tokens": args.prefix_len + 8,
        "cold_ttft_s": [round(s, 3) for s, _ in cold],
        "repeat_ttft_s": [round(s, 3) for s, _ in warm],
        "repeat_cached_tokens": [c for _, c in warm],
        "cold_median_s": round(statistics.median(s for s, _ in cold), 3),
        "repeat_median_s": round(statistics.median(s for s, _ in warm), 3),
    }
    result["speedup"] = round(result["cold_median_s"] / result["repeat_median_s"], 2)
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
