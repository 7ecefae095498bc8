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
costs. With --repeats R the whole measurement (--num-iters runs at --output-len, then
--num-iters at one token) is made R times: the decode step printed is the median of the R
steps, each run's step listed after it, and the latencies are all R x --num-iters. The
warm-up runs both shapes (--num-iters-warmup runs at --output-len, one at one token). The
roofline compares the median step with the device's memory and compute bounds at the
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
from jaxserve.entrypoints.cli_args import engine_args_from


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser("latency", __doc__)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the decode step this many times (each --num-iters at both lengths)",
    )
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

    roofline_runs = not args.no_roofline and args.output_len > 1
    print("Warming up...")
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        run_to_completion(args.output_len)
    if roofline_runs and args.num_iters_warmup:
        run_to_completion(1)  # every shape the timed runs take runs once before them
    runs, prefills = [], []
    for r in range(max(1, args.repeats)):
        runs.append(
            [
                run_to_completion(args.output_len)
                for _ in tqdm(range(args.num_iters), desc=f"Profiling iterations {r}")
            ]
        )
        if roofline_runs:
            prefills.append(float(np.mean([run_to_completion(1) for _ in range(args.num_iters)])))
    runner.close()
    latencies = np.array([t for run in runs for t in run])
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
    if prefills:
        steps = [
            decode_step_seconds(float(np.mean(run)), prefill, args.output_len)
            for run, prefill in zip(runs, prefills, strict=True)
        ]
        step, prefill = float(np.median(steps)), float(np.median(prefills))
        print(
            f"Decode step: {1e3 * step:.2f} ms (median of {len(steps)} runs: "
            f"{', '.join(f'{1e3 * s:.2f}' for s in steps)} ms; each (avg latency - avg at one "
            f"output token) / {args.output_len - 1}); {args.batch_size * args.n / step:.1f} "
            "tokens/s"
        )
        results.update(decode_step_runs_ms=[1e3 * s for s in steps], prefill_latency_runs=prefills)
        roofline = roofline_report(
            runner.config, step, args.batch_size * args.n, args.input_len, args.output_len
        )
        print_roofline(roofline)
        results.update(
            prefill_latency=prefill, decode_step_ms=1e3 * step, roofline=roofline.to_dict()
        )
    if args.output_json:
        write_json(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
