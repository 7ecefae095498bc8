"""Latency of one batch, vLLM `bench latency` style, with HF transformers as the peer.

--batch-size prompts of --input-len random token ids, each sampled to exactly --output-len
tokens (temperature 1.0, ignore_eos), one generate() call per iteration after
--num-iters-warmup untimed ones. jaxserve's prefix cache is reset before each iteration (not
timed), so the repeated prompts are prefilled in full every time, as HF's are. Prints vLLM's lines:

    Avg latency: X seconds
    P% percentile latency: Y seconds        (P = 10, 25, 50, 75, 90, 99)

then the decode step and its roofline. The decode step is derived from latencies, so both
backends are measured alike: (avg latency - avg latency of the same batch at one output
token) / (output_len - 1); the one-token run takes the prefill and the fixed per-request
costs. The roofline compares that step with the device's memory and compute bounds at the
batch's mean context length (jaxserve/benchmarks/roofline.py).

`--backend hf` times transformers' `generate` on the same prompts and shape. Engine flags are
`jaxserve serve`'s (-tp, --max-model-len, --load-format dummy, ...).

    .venv/bin/python scripts/bench_latency.py --batch-size 8 --input-len 32 --output-len 128
    .venv/bin/python scripts/bench_latency.py --backend hf --batch-size 8
    .venv/bin/python scripts/bench_latency.py --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --batch-size 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm.auto import tqdm

from jaxserve.benchmarks.common import (
    PERCENTAGES,
    add_benchmark_args,
    benchmark_parser,
    decode_step_seconds,
    git_commit,
    print_roofline,
    random_prompt_ids,
    roofline_report,
    write_json,
)
from jaxserve.entrypoints.cli import engine_args_from


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser("latency", __doc__)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    add_benchmark_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from jaxserve.benchmarks.runners import make_runner

    runner = make_runner(args.backend, engine_args_from(args))
    prompts = random_prompt_ids(
        args.batch_size, args.input_len, runner.config.vocab_size, args.seed
    )

    def run_to_completion(output_len: int) -> float:
        runner.reset_prefix_cache()  # every iteration prefills in full, as HF's does
        start = time.perf_counter()
        runner.generate(prompts, output_len, args.n)
        return time.perf_counter() - start

    print("Warming up...")
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        run_to_completion(args.output_len)
    latencies = np.array(
        [
            run_to_completion(args.output_len)
            for _ in tqdm(range(args.num_iters), desc="Profiling iterations")
        ]
    )
    prefill = None
    if not args.no_roofline and args.output_len > 1:
        short = [run_to_completion(1) for _ in tqdm(range(args.num_iters + 1),
                                                    desc="One-token iterations")][1:]  # fmt: skip
        prefill = float(np.mean(short))
    runner.close()

    percentiles = np.percentile(latencies, PERCENTAGES)
    avg = float(np.mean(latencies))
    print(f"Avg latency: {avg} seconds")
    for percentage, percentile in zip(PERCENTAGES, percentiles, strict=True):
        print(f"{percentage}% percentile latency: {percentile} seconds")
    results = {
        "avg_latency": avg,
        "latencies": latencies.tolist(),
        "percentiles": dict(zip(PERCENTAGES, percentiles.tolist(), strict=True)),
        "backend": args.backend,
        "commit": git_commit(),
        "args": vars(args),
    }
    step = decode_step_seconds(avg, prefill, args.output_len) if prefill is not None else None
    if step is not None:
        print(
            f"Decode step: {1e3 * step:.2f} ms ((avg latency - {prefill:.4f} s at one output "
            f"token) / {args.output_len - 1}); {args.batch_size * args.n / step:.1f} tokens/s"
        )
        roofline = roofline_report(
            runner.config, step, args.batch_size * args.n, args.input_len, args.output_len
        )
        print_roofline(roofline)
        results.update(prefill_latency=prefill, decode_step_ms=1e3 * step,
                       roofline=roofline.to_dict())  # fmt: skip
    if args.output_json:
        write_json(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
