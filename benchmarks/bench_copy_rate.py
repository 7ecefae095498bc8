"""The device's copy rate: what a kernel that reads and writes memory at full speed reaches.

A jitted `x * s` over an --megabytes array (s a runtime scalar, so XLA cannot fold it into a
plain alias) reads and writes every byte once: GB/s counts both, 2 x the array's bytes per
call. Each call is synchronised (block_until_ready); --iters timed calls after --warmup, the
median and the best printed. The GPU suite gives every bandwidth fraction against this rate
beside the datasheet's (an H100 SXM copies at about 3.0 TB/s against its 3.35).

    python benchmarks/bench_copy_rate.py --megabytes 4096 --output-json copy.json
    python benchmarks/bench_copy_rate.py --smoke        # 64 MB on CPU

Prints `Copy rate: X GB/s (median of N, best Y GB/s; 2 x M MiB a call) on DEVICE`.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.benchmarks.roofline import datasheet_peaks


def copy_rate(megabytes: int, *, warmup: int, iters: int) -> dict:
    n = megabytes * 2**20 // 4
    x = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32) * 1e-9)()  # every page written
    scale = jnp.float32(1.0)
    scaled = jax.jit(lambda x, s: x * s)
    for _ in range(warmup):
        jax.block_until_ready(scaled(x, scale))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(scaled(x, scale))
        times.append(time.perf_counter() - start)
    moved = 2 * n * 4  # read and written
    device = jax.devices()[0]
    peak = datasheet_peaks(device.device_kind, jnp.bfloat16)
    return dict(
        device=device.device_kind, platform=device.platform, bytes_per_call=moved,
        median_s=float(np.median(times)), best_s=float(min(times)),
        copy_gbps=moved / float(np.median(times)) / 1e9, best_gbps=moved / min(times) / 1e9,
        datasheet_gbps=peak.bandwidth / 1e9 if peak else None, iters=iters,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=int, default=4096, help="MiB of the array copied")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="64 MiB, few iterations (CPU)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.megabytes, args.warmup, args.iters = 64, 1, 5
    r = copy_rate(args.megabytes, warmup=args.warmup, iters=args.iters)
    print(
        f"Copy rate: {r['copy_gbps']:.1f} GB/s (median of {r['iters']}, best "
        f"{r['best_gbps']:.1f} GB/s; 2 x {args.megabytes} MiB a call) on {r['device']}"
    )
    if r["datasheet_gbps"]:
        print(f"Datasheet: {r['datasheet_gbps']:.1f} GB/s; the copy reaches "
              f"{r['copy_gbps'] / r['datasheet_gbps']:.0%} of it")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=2)
            f.write("\n")
    return r


if __name__ == "__main__":
    main()
