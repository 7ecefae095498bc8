"""The engine core's batch queue over simulated pipeline stages (worker/simulated.py): decode
throughput and stage utilisation at pipeline_parallel_size 1, 2, 4, with the queue holding pp
micro-batches (the engine's) and, for the bubble, with one micro-batch at a time. The step
costs BASE_MS + PER_TOKEN_MS per token for the whole model, split evenly over the stages; the
scheduler, KV block manager and frontend are the real ones (engine core in this process).

    python benchmarks/bench_pipeline.py [--step 20,0.05] [--requests 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import time

# the engine checks that pp stages have devices before it builds its (simulated) runner: give
# this process 4 host devices (read when jax starts, so before jaxserve imports it)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def run(pp: int, depth: int | None, args) -> dict:
    engine = LLMEngine.from_engine_args(
        EngineArgs(model="llama-3.2-1b", load_format="dummy", pipeline_parallel_size=pp,
                   max_model_len=1024, max_num_seqs=args.requests,
                   max_num_batched_tokens=max(256, args.requests * 8),
                   num_gpu_blocks_override=4096),
        multiprocess=False,
    )  # fmt: skip
    core = engine.engine_core.engine_core
    if depth is not None:
        core.max_in_flight = depth
    base, per_token = (float(x) / 1e3 for x in args.step.split(","))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(str(i), {"prompt_token_ids": [1 + i % 1000] * 16}, params)
    depths = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        depths.append(engine.scheduler_stats.num_batches_in_flight)
    wall = time.perf_counter() - start
    busy = core.runner.busy_total  # seconds of stage work dispatched, summed over stages
    preemptions = core.scheduler.total_preemptions
    engine.shutdown()
    tokens = args.requests * args.tokens
    decode = [d for d in depths if d]
    return {
        "pp": pp, "queue": depth or pp, "wall_s": wall, "tokens_per_s": tokens / wall,
        "mean_in_flight": sum(decode) / max(len(decode), 1), "preemptions": preemptions,
        "utilisation": busy / (pp * wall),
        "base_ms": base * 1e3, "per_token_ms": per_token * 1e3,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", default="20,0.05", help="BASE_MS,PER_TOKEN_MS (whole model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ["JAXSERVE_SIMULATED_STEP"] = args.step
    rows = [run(1, None, args)]
    for pp in (2, 4):
        rows += [run(pp, None, args), run(pp, 1, args)]
    print(f"simulated step {args.step} ms (base, per token), {args.requests} requests x "
          f"{args.tokens} tokens\n")  # fmt: skip
    print("| pp | queue depth | mean in flight | tokens/s | stage utilisation |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pp']} | {r['queue']} | {r['mean_in_flight']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['utilisation']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
