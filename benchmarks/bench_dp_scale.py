"""Data parallelism at scales this machine cannot hold: a Poisson load spread over N engines.

Every engine core is a real process with its real scheduler and KV block manager behind the
real DP coordinator, load balancer and AsyncLLM frontend; only the device step is simulated
(jaxserve/worker/simulated.py: `--step-ms` + `--token-ms` per scheduled token, random
tokens), so N engines cost N sleeping processes. For each N in --engines, requests arrive as a
Poisson process at N x --rate-per-engine requests/s (each engine sees the same load at every
N), N x --prompts-per-engine of them, with prompt and output lengths uniform within
--range-ratio of --input-len / --output-len. Reported per N: output tokens/s in all and per
engine, requests per engine and their balance (max / mean), each engine's queue depth (waiting
requests, from its scheduler stats: mean and max), TTFT and TPOT.

    .venv/bin/python benchmarks/bench_dp_scale.py --engines 1 2 4 8 \\
        --output-json benchmarks/results/dp-scale-simulated.json

The defaults model a Llama-3-8B-class decode on one accelerator (15 ms a step + 0.02 ms a
token: ~65 decode steps/s at small batches) with 64 sequences per engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import defaultdict

import numpy as np

from jaxserve.benchmarks.common import benchmark_parser, git_commit, machine, write_json
from jaxserve.worker.simulated import SIMULATE_ENV


class LoadSampler:
    """A stat logger (AsyncLLM.stat_loggers): each engine's waiting / running as its
    scheduler reports them, integrated over time."""

    def __init__(self, num_engines: int):
        self.state = [(0, 0)] * num_engines
        self.samples: list[list[tuple[int, int]]] = [[] for _ in range(num_engines)]

    def record(self, sched, it, engine: int = 0) -> None:
        if sched is not None:
            self.state[engine] = (sched.num_waiting_reqs, sched.num_running_reqs)

    async def run(self, every: float = 0.05) -> None:
        while True:
            for engine, state in enumerate(self.state):
                self.samples[engine].append(state)
            await asyncio.sleep(every)


async def run_once(args: argparse.Namespace, num_engines: int) -> dict:
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.sampling_params import SamplingParams

    engine_args = EngineArgs(
        model=args.model, load_format="dummy", data_parallel_size=num_engines,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len * 2 + args.output_len * 2,
        num_gpu_blocks_override=args.num_blocks, async_scheduling=True,
    )  # fmt: skip
    llm = AsyncLLM.from_engine_args(engine_args)
    sampler = LoadSampler(num_engines)
    llm.stat_loggers.append(sampler)
    n = args.prompts_per_engine * num_engines
    rng = np.random.default_rng(args.seed)
    lo, hi = 1 - args.range_ratio, 1 + args.range_ratio
    input_lens = rng.integers(int(args.input_len * lo), int(args.input_len * hi) + 1, n)
    output_lens = rng.integers(int(args.output_len * lo), int(args.output_len * hi) + 1, n)
    gaps = rng.exponential(1.0 / (args.rate_per_engine * num_engines), n)
    vocab = llm.config.model.vocab_size
    per_engine: dict[int, list] = defaultdict(list)  # engine -> (output tokens, ttft, tpot)

    async def one(i: int) -> None:
        prompt = {"prompt_token_ids": rng.integers(100, vocab, input_lens[i]).tolist()}
        params = SamplingParams(max_tokens=int(output_lens[i]), ignore_eos=True, temperature=1.0)
        start = time.perf_counter()
        first = engine = None
        tokens = 0
        async for out in llm.generate(prompt, params, f"r{i}"):
            if first is None:
                first = time.perf_counter() - start
                engine = llm.engine_core.engine_of(f"r{i}")
            tokens = len(out.outputs[0].token_ids)
        total = time.perf_counter() - start
        per_engine[engine].append((tokens, first, (total - first) / max(tokens - 1, 1)))

    sampling = asyncio.create_task(sampler.run())
    start = time.perf_counter()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(gaps[i])
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    sampling.cancel()
    llm.shutdown()

    requests = [len(per_engine[e]) for e in range(num_engines)]
    tokens = [sum(r[0] for r in per_engine[e]) for e in range(num_engines)]
    everything = [r for e in range(num_engines) for r in per_engine[e]]
    waiting = [[w for w, _ in sampler.samples[e]] or [0] for e in range(num_engines)]
    return {
        "engines": num_engines,
        "requests": n,
        "request_rate": args.rate_per_engine * num_engines,
        "duration_s": duration,
        "output_throughput": sum(tokens) / duration,
        "output_throughput_per_engine": [t / duration for t in tokens],
        "requests_per_engine": requests,
        "balance_max_over_mean": max(requests) / (n / num_engines),
        "mean_queue_depth_per_engine": [float(np.mean(w)) for w in waiting],
        "max_queue_depth_per_engine": [int(max(w)) for w in waiting],
        "mean_ttft_ms": 1e3 * float(np.mean([r[1] for r in everything])),
        "p99_ttft_ms": 1e3 * float(np.percentile([r[1] for r in everything], 99)),
        "mean_tpot_ms": 1e3 * float(np.mean([r[2] for r in everything])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser("dp-scale", __doc__)
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--model", default="llama-3-8b", help="a --load-format dummy preset")
    parser.add_argument("--rate-per-engine", type=float, default=4.0, help="requests/s")
    parser.add_argument("--prompts-per-engine", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--step-ms", type=float, default=15.0)
    parser.add_argument("--token-ms", type=float, default=0.02)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    os.environ[SIMULATE_ENV] = f"{args.step_ms},{args.token_ms}"  # read by the engine cores
    runs = []
    for num_engines in args.engines:
        result = asyncio.run(run_once(args, num_engines))
        runs.append(result)
        print(
            f"dp={num_engines}: {result['output_throughput']:.0f} output tok/s "
            f"({result['output_throughput'] / num_engines:.0f} per engine), requests per "
            f"engine {result['requests_per_engine']} (max/mean "
            f"{result['balance_max_over_mean']:.2f}), mean queue depth "
            f"{[round(q, 1) for q in result['mean_queue_depth_per_engine']]}, max "
            f"{result['max_queue_depth_per_engine']}, TTFT mean {result['mean_ttft_ms']:.0f} ms"
            f" p99 {result['p99_ttft_ms']:.0f} ms, TPOT {result['mean_tpot_ms']:.1f} ms",
            flush=True,
        )
    if args.output_json:
        write_json(args.output_json, {
            "command": " ".join([sys.executable, *sys.argv]), "commit": git_commit(),
            "machine": machine(), "args": vars(args), "runs": runs,
        })  # fmt: skip


if __name__ == "__main__":
    main()
