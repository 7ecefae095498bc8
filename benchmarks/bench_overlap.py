"""Host time per step and device idle gap, with async scheduling on and off (same run).

The EngineCore runs in this process on the default model; every request is submitted at
once (random prompt ids, ignore_eos). Throughput is the best of --repeats plain runs after a
warm-up; the per-step figures come from one more, instrumented run:

- wall: one `EngineCore.step()` call that returns outputs (schedule + dispatch + fetch +
  update; with async scheduling the step fetched is the previous one);
- wait: time blocked in `ModelRunner.fetch` until the device finished the step (the one host
  sync); host = wall - wait, the Python work per step;
- device: a watcher thread polls each dispatched step's output (`is_ready()`, every 0.1 ms)
  and records when it finished; a step runs from max(its dispatch, the previous step's end)
  to its end, and the device idles from one step's end to the next step's dispatch when that
  comes later. Medians over the decode steps (the first and last 4 steps are left out).

    .venv/bin/python benchmarks/bench_overlap.py --num-prompts 32 --input-len 32 \
        --output-len 128
"""

from __future__ import annotations

import argparse
import platform
import queue
import threading
import time

import jax
import msgspec
import numpy as np


def run(args, prompts: list[list[int]], async_scheduling: bool) -> dict:
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.core import EngineCore
    from jaxserve.ipc.messages import EngineCoreRequest
    from jaxserve.sampling_params import SamplingParams

    config = EngineArgs(
        args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=async_scheduling,
    ).create_engine_config()  # fmt: skip
    core = EngineCore(config)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=args.output_len)
    ids = iter(range(10**9))

    def generate(batch, sampling) -> tuple[float, list[float]]:
        for p in batch:
            core.add_request(EngineCoreRequest(f"r{next(ids)}", p, sampling, None, time.time()))
        walls = []
        start = time.perf_counter()
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            out = core.step()
            if out is not None:
                walls.append(time.perf_counter() - t0)
            elif walls:  # a dispatch-only call after the first: count its time too
                walls[-1] += time.perf_counter() - t0
        return time.perf_counter() - start, walls

    generate(prompts[:4], msgspec.structs.replace(params, max_tokens=8))  # warm-up
    tokens = len(prompts) * args.output_len
    tokens_per_s = max(tokens / generate(prompts, params)[0] for _ in range(args.repeats))

    runner = core.runner
    dispatched: list[float] = []  # when each step's dispatch returned
    finished: list[float] = []  # when each step's outputs were ready on the device
    waits: list[float] = []
    watch: queue.Queue = queue.Queue()

    def watcher():
        while (arr := watch.get()) is not None:
            while not arr.is_ready():
                time.sleep(1e-4)
            finished.append(time.perf_counter())

    dispatch, fetch = runner.dispatch, runner.fetch

    def timed_dispatch(so):
        pending = dispatch(so)
        if pending is not None:
            dispatched.append(time.perf_counter())
            watch.put(pending.fetch["ids"])
        return pending

    def timed_fetch(pending):
        start = time.perf_counter()
        jax.block_until_ready(pending.fetch)
        waits.append(time.perf_counter() - start)
        return fetch(pending)

    runner.dispatch, runner.fetch = timed_dispatch, timed_fetch
    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    _, walls = generate(prompts, params)
    watch.put(None)
    thread.join()
    d, f = np.array(dispatched), np.array(finished)
    busy = f - np.maximum(d, np.concatenate([[0.0], f[:-1]]))
    idle = np.maximum(0.0, d[1:] - f[:-1])
    mid = slice(4, -4)
    wall, wait = np.median(walls[mid]), np.median(waits[mid])
    return dict(
        mode="async" if async_scheduling else "sync", tokens_per_s=tokens_per_s,
        steps=len(walls), wall_ms=wall * 1e3, wait_ms=wait * 1e3, host_ms=(wall - wait) * 1e3,
        device_ms=np.median(busy[mid]) * 1e3, idle_ms=np.median(idle[mid]) * 1e3,
        idle_share=idle[mid].sum() / (f[-5] - d[4]),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    prompts = rng.integers(100, 20000, (args.num_prompts, args.input_len)).tolist()
    results = [run(args, prompts, a) for a in (False, True)]
    print(f"{jax.devices()[0].device_kind}, {platform.machine()}, jax {jax.__version__}")
    print("| mode | output tok/s | steps | wall ms/step | wait ms | host ms | device ms "
          "| idle ms/step | device idle share |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['steps']} | {r['wall_ms']:.2f} | "
            f"{r['wait_ms']:.2f} | {r['host_ms']:.2f} | {r['device_ms']:.2f} | "
            f"{r['idle_ms']:.3f} | {100 * r['idle_share']:.2f}% |"
        )
    ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"async / sync throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
