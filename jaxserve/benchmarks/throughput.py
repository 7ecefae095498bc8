"""Offline throughput, vLLM `bench throughput` style, with HF transformers as the peer.

Random prompt token ids of --input-len, --output-len tokens each (ignore_eos), all submitted
at once; prints `Throughput: X requests/s, Y total tokens/s, Z output tokens/s`.
`--backend hf` runs the same prompts through transformers' `generate` (one padding-free batch
of --num-prompts, since all prompts have the same length), for a same-run comparison.
jaxserve's start-up (compiling its buckets) is not timed, as vLLM's is not: a warm-up runs
the same prompts untimed first (at --output-len, and at one token when that is timed too), so
every step shape the timed runs take has run once. --repeats R times R runs; the figures are
their median (`Runs:` lists each run's seconds).

When every sequence decodes in one batch (--num-prompts x --n <= --max-num-seqs; always for
hf), the decode step and its roofline follow, as in scripts/bench_latency.py: (elapsed -
elapsed of the same prompts at one output token) / (output_len - 1), the median of the R
runs' steps.

    .venv/bin/python benchmarks/bench_throughput.py --num-prompts 32 --input-len 32 \\
        --output-len 128 --backend jaxserve
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve.benchmarks.common import (
    add_benchmark_args,
    benchmark_parser,
    decode_step_seconds,
    git_commit,
    machine,
    print_roofline,
    random_prompt_ids,
    roofline_report,
    write_json,
)
from jaxserve.entrypoints.cli_args import engine_args_from


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser("throughput", __doc__)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs (the median counts)")
    add_benchmark_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from jaxserve.benchmarks.runners import make_runner

    runner = make_runner(args.backend, engine_args_from(args))
    prompts = random_prompt_ids(
        args.num_prompts, args.input_len, runner.config.vocab_size, args.seed
    )
    num_seqs = args.num_prompts * args.n
    one_batch = runner.max_num_seqs is None or num_seqs <= runner.max_num_seqs
    one_token = one_batch and not args.no_roofline and args.output_len > 1

    def timed(output_len: int, progress: bool = False) -> float:
        runner.reset_prefix_cache()  # the same prompts again: prefilled in full
        start = time.perf_counter()
        runner.generate(prompts, output_len, args.n, use_tqdm=progress)
        return time.perf_counter() - start

    timed(args.output_len)  # the warm-up: the same prompts and step shapes, untimed
    if one_token:
        timed(1)
    runs, prefills = [], []
    for _ in range(max(1, args.repeats)):
        runs.append(timed(args.output_len, not args.quiet))
        if one_token:
            prefills.append(timed(1))
    runner.close()
    elapsed = float(np.median(runs))

    requests = args.num_prompts
    out_tokens = num_seqs * args.output_len
    total_tokens = requests * args.input_len + out_tokens
    print(
        f"Throughput: {requests / elapsed:.2f} requests/s, {total_tokens / elapsed:.2f} total "
        f"tokens/s, {out_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"({args.backend}, {machine()}, {elapsed:.1f} s)")
    print(f"Runs: {', '.join(f'{t:.3f}' for t in runs)} s (median of {len(runs)})")
    results = dict(
        backend=args.backend,
        elapsed_time=elapsed,
        num_requests=requests,
        total_num_tokens=total_tokens,
        requests_per_second=requests / elapsed,
        tokens_per_second=total_tokens / elapsed,
        output_tokens_per_second=out_tokens / elapsed,
        run_times=runs,
        commit=git_commit(),
        args=vars(args),
    )
    if prefills:
        steps = [
            decode_step_seconds(t, p, args.output_len) for t, p in zip(runs, prefills, strict=True)
        ]
        step, prefill = float(np.median(steps)), float(np.median(prefills))
        print(
            f"Decode step: {1e3 * step:.2f} ms (median of {len(steps)} runs: "
            f"{', '.join(f'{1e3 * s:.2f}' for s in steps)} ms; each (elapsed - elapsed at one "
            f"output token) / {args.output_len - 1}) over {num_seqs} sequences"
        )
        results.update(decode_step_runs_ms=[1e3 * s for s in steps], prefill_times=prefills)
        roofline = roofline_report(runner.config, step, num_seqs, args.input_len, args.output_len)
        print_roofline(roofline)
        results.update(prefill_time=prefill, decode_step_ms=1e3 * step, roofline=roofline.to_dict())
    if args.output_json:
        write_json(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
