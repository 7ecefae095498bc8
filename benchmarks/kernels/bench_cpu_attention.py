"""Decode attention on CPU: the C++ kernel (`--attention-backend cpu`) against the jnp reference,
measured in the same run.

The default model's head shapes by default (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim
64, f32, block 16), one layer's KV cache, every sequence decoding (one query row each) with
kv_len drawn around --contexts (+-25%), blocks from a shuffled pool. The two ops are called
alternately, --iters times each after warm-up; the medians are printed with the bandwidth
each reaches over the K/V bytes the batch's rows must read, and the speed-up.

    .venv/bin/python benchmarks/kernels/bench_cpu_attention.py --output-json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import jax
import numpy as np

from pallas_kernels.paged_attention import ragged_paged_attention_reference
from pallas_kernels.paged_attention.cpu import (
    cpu_kernel_unavailable_message,
    ragged_paged_attention_cpu,
)


def decode_case(batch: int, context: int, args, rng) -> tuple[tuple, int]:
    """Inputs of one all-decode step, and the K/V bytes its rows read."""
    bs, hkv, d = args.block_size, args.num_kv_heads, args.head_dim
    lens = rng.integers(max(1, context * 3 // 4), context * 5 // 4 + 1, batch).astype(np.int32)
    per_seq = -(-lens // bs)
    num_blocks = int(per_seq.sum()) + 1
    pool = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((batch, int(per_seq.max())), np.int32)
    offsets = np.concatenate([[0], np.cumsum(per_seq)])
    for s in range(batch):
        tables[s, : per_seq[s]] = pool[offsets[s] : offsets[s + 1]]
    cache = lambda: rng.standard_normal((num_blocks, bs, hkv, d), np.float32)  # noqa: E731
    q = rng.standard_normal((batch, args.num_q_heads, d), np.float32)
    inputs = (q, cache(), cache(), lens, tables, np.arange(batch + 1, dtype=np.int32),
              np.array([batch], np.int32))  # fmt: skip
    return tuple(jax.device_put(x) for x in inputs), int(lens.sum()) * hkv * d * 4 * 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[160, 512, 2048])
    parser.add_argument("--num-q-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if reason := cpu_kernel_unavailable_message():
        raise SystemExit(reason)
    scale = args.head_dim**-0.5
    ops = {
        name: jax.jit(functools.partial(op, sm_scale=scale, decode_only=True))
        for name, op in (
            ("cpu", ragged_paged_attention_cpu),
            ("reference", ragged_paged_attention_reference),
        )  # fmt: skip
    }
    rng = np.random.default_rng(0)
    rows = []
    print(f"{platform.processor() or platform.machine()}, jax {jax.__version__}")
    print("| batch | context | cpu kernel ms | GB/s | reference ms | GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        for context in args.contexts:
            inputs, nbytes = decode_case(batch, context, args, rng)
            times = {name: [] for name in ops}
            for op in ops.values():
                jax.block_until_ready(op(*inputs))
            for _ in range(args.iters):
                for name, op in ops.items():
                    start = time.perf_counter()
                    jax.block_until_ready(op(*inputs))
                    times[name].append(time.perf_counter() - start)
            ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
            row = dict(batch=batch, context=context, kv_bytes=nbytes, **{
                f"{name}_ms": v for name, v in ms.items()})  # fmt: skip
            rows.append(row)
            gbs = {name: nbytes / v / 1e6 for name, v in ms.items()}
            print(f"| {batch} | {context} | {ms['cpu']:.3f} | {gbs['cpu']:.1f} | "
                  f"{ms['reference']:.3f} | {gbs['reference']:.1f} | "
                  f"{ms['reference'] / ms['cpu']:.2f}x |")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(args=vars(args), jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
