"""The dense model's four GEMM shapes under XLA's GEMM backends (issue 68 item 4): XLA's
Triton GEMMs as it autotunes them (`default`), cuBLAS alone (`cublas`:
--xla_gpu_enable_triton_gemm=false) and no autotuning (`autotune0`: --xla_gpu_autotune_level=0,
the heuristic's configurations), each setting in a process of its own (XLA reads its flags
once), at T tokens each.

Shapes, for --model's config (llama-3-8b by default): qkv [D, (Hq + 2 Hkv) hd], o [Hq hd, D],
gate_up [D, 2F], down [F, D], bf16 weights, x [T, in] bf16: `x @ w` jitted, the median of
--iters synchronised calls after a warm-up. Prints a table (ms per setting, and the weight
bytes over the best time as GB/s) and a summary line per shape and T starting `# gemm `.

    python benchmarks/kernels/bench_gemm_backends.py --tokens 1,32,256 --output-json gemm.json
    python benchmarks/kernels/bench_gemm_backends.py --smoke     # tiny shapes (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {
    "default": "",
    "cublas": "--xla_gpu_enable_triton_gemm=false",
    "autotune0": "--xla_gpu_autotune_level=0",
}


def shapes(model: str, smoke: bool) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of the model's projections."""
    if smoke:
        return {"qkv": (64, 128), "o": (64, 64), "gate_up": (64, 256), "down": (128, 64)}
    from jaxserve.transformers_utils.config import read_model_config

    c = read_model_config(model, load_format="dummy")
    d, hd = c.hidden_size, c.head_dim
    return {
        "qkv": (d, (c.num_heads + 2 * c.num_kv_heads) * hd),
        "o": (c.num_heads * hd, d),
        "gate_up": (d, 2 * c.intermediate_size),
        "down": (c.intermediate_size, d),
    }


def worker(args) -> dict:
    """This process's setting: {shape: {T: seconds}}."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    matmul = jax.jit(lambda x, w: x @ w)
    out: dict[str, dict[int, float]] = {}
    for name, (n_in, n_out) in shapes(args.model, args.smoke).items():
        w = jax.random.normal(jax.random.key(0), (n_in, n_out), jnp.bfloat16)
        out[name] = {}
        for t in args.tokens:
            x = jax.random.normal(jax.random.key(1), (t, n_in), jnp.bfloat16)
            jax.block_until_ready(matmul(x, w))
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                jax.block_until_ready(matmul(x, w))
                times.append(time.perf_counter() - start)
            out[name][t] = float(np.median(times))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--tokens", default="1,32,256", help="comma-separated T")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="of " + ", ".join(SETTINGS))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    if args.smoke:
        args.iters = min(args.iters, 3)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    results: dict[str, dict] = {}
    for setting in args.settings.split(","):
        flags = f"{os.environ.get('XLA_FLAGS', '')} {SETTINGS[setting]}".strip()
        cmd = [sys.executable, __file__, "--worker", setting, "--model", args.model,
               "--tokens", ",".join(map(str, args.tokens)), "--iters", str(args.iters)]  # fmt: skip
        cmd += ["--smoke"] if args.smoke else []
        proc = subprocess.run(
            cmd, env={**os.environ, "XLA_FLAGS": flags}, capture_output=True, text=True
        )
        if proc.returncode:
            print(f"{setting}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
    names = list(results)
    print("| shape | T | " + " | ".join(f"{s} ms" for s in names) + " | best | GB/s |")
    print("|" + "---|" * (len(names) + 4))
    sizes = shapes(args.model, args.smoke)
    for shape, (n_in, n_out) in sizes.items():
        for t in args.tokens:
            ms = {s: 1e3 * results[s][shape][str(t)] for s in names}
            best = min(ms, key=ms.get)
            gbps = n_in * n_out * 2 / (ms[best] / 1e3) / 1e9
            cells = " | ".join(f"{ms[s]:.4f}" for s in names)
            print(f"| {shape} | {t} | {cells} | {best} | {gbps:.0f} |")
    for shape in sizes:
        for t in args.tokens:
            ms = {s: 1e3 * results[s][shape][str(t)] for s in names}
            if "default" in ms:
                rel = ", ".join(f"{s} {ms['default'] / v:.2f}x" for s, v in ms.items())
                print(f"# gemm {shape} T={t}: default {ms['default']:.4f} ms; {rel}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": SETTINGS, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
