"""The routed experts' grouped matmul (one MoE projection, rows sorted by expert) at a model's
shapes, each available implementation against XLA's default `jax.lax.ragged_dot`, as GB/s over
the routed experts' weight bytes (packed bytes for the quantized formats) and as a fraction of
a measured copy rate.

Implementations (each skipped with its error where it does not run):
  xla          jax.lax.ragged_dot, XLA's lowering (on NVIDIA: a dense dot over every group)
  xla_triton   the same under jax_ragged_dot_use_gpu_pallas_triton_lowering (a Pallas gmm)
  xla_cudnn    the same with XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion (run in a
               child process: XLA reads its flags once)
  tokamax      tokamax.ragged_dot(implementation="mosaic"), bf16 weights
  mosaic       jaxserve's own Mosaic GPU kernel (pallas_kernels/grouped_matmul/mosaic.py), weights
               in jaxserve's packed layout (packed.py), decoded inside the kernel (mosaic_bN:
               N output columns an item)
  tokamax_fp8 / tokamax_int4 / tokamax_mxfp4
               the same with qwix QArray weights kept packed: fp8 e4m3 with one scale per
               (128 rows of K, column), int4 with one per (128 of K, column), fp4 e2m1 with one
               per (32 of K, column) (MXFP4's e8m0 scales are exact in bf16); the weights are
               stored [G, N, K] (the kernels' layout; the QArray is its transpose view)

Shapes (--shapes): gpt-oss-20b (E 32, D 2880, F 2880, top-4), qwen3-30b-a3b (E 128, D 2048,
F 768, top-8); projections w13 (D -> 2F) and w2 (F -> D). Each token picks top-k distinct
experts at random (seeded); the bytes counted are the distinct routed experts' weights.

    python benchmarks/kernels/bench_moe_gmm.py --output-json out.json [--copy-gbps 2874]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # name: (experts, hidden, moe intermediate, top-k)
    "gpt-oss-20b": (32, 2880, 2880, 4),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
}
# the formats each shape's published checkpoints come in (gpt-oss: MXFP4; D 2880 is no multiple
# of a 128-row scale block)
SHAPE_FORMATS = {
    "gpt-oss-20b": ("bf16", "mxfp4"),
    "qwen3-30b-a3b": ("bf16", "fp8", "int4", "mxfp4"),
}
FORMATS = {"bf16": None, "fp8": 128, "int4": 128, "mxfp4": 32}  # format: K rows a scale spans
QTYPES = {"fp8": jnp.float8_e4m3fn, "int4": jnp.int4, "mxfp4": jnp.float4_e2m1fn}
BITS = {"bf16": 16, "fp8": 8, "int4": 4, "mxfp4": 4}


def routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """group sizes i32[E] of `tokens` tokens each routed to top_k distinct random experts."""
    rng = np.random.default_rng(seed + tokens)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    return np.bincount(ids.reshape(-1), minlength=experts).astype(np.int32)


def make_weights(fmt: str, g: int, k: int, n: int, key: jax.Array):
    """(weights as the implementation takes them, the bf16 weights they stand for [G, K, N],
    bytes per expert in device memory)."""
    if fmt == "bf16":
        w = (jax.random.normal(key, (g, k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
        return w, w, k * n * 2
    import qwix

    tile = FORMATS[fmt]
    qtype = QTYPES[fmt]
    if fmt == "int4":
        q = jax.random.randint(key, (g, n, k), -8, 8, jnp.int32).astype(jnp.int4)
    else:
        q = (jax.random.normal(key, (g, n, k), jnp.float32) * 2).astype(qtype)
    exps = jax.random.randint(jax.random.fold_in(key, 1), (g, n, k // tile), -9, -5)
    scale = jnp.exp2(exps.astype(jnp.float32)).astype(jnp.bfloat16)  # powers of two
    qarray = qwix.QArray(qvalue=q.mT, scale=scale.mT, qtype=qtype)
    dense = (q.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), tile, axis=2)).mT
    per_expert = n * k * BITS[fmt] // 8 + n * (k // tile) * 2
    return qarray, dense.astype(jnp.bfloat16), per_expert


def make_packed(fmt: str, g: int, k: int, n: int, key: jax.Array):
    """make_weights' triple with the weights in jaxserve's packed layout (packed.py)."""
    from pallas_kernels.grouped_matmul.packed import Packed

    if fmt == "bf16":
        return make_weights(fmt, g, k, n, key)
    group = FORMATS[fmt]
    k1, k2 = jax.random.split(key)
    if fmt == "fp8":
        kernel = (jax.random.normal(k1, (g, k, n)) * 2).astype(jnp.float8_e4m3fn)
    else:
        kernel = jax.random.bits(k1, (g, k // 2, n), jnp.uint8)
    if fmt == "mxfp4":
        scale = jax.random.randint(k2, (g, k // group, n), 118, 122).astype(jnp.uint8)
    else:
        scale = jnp.exp2(jax.random.randint(k2, (g, k // group, n), -9, -5).astype(jnp.float32))
    w = Packed(kernel, scale, None, group)
    per_expert = w.nbytes // g
    return w, w.dense(jnp.bfloat16), per_expert


def implementation(name: str):
    """(x [M, K], w, group_sizes [G]) -> [M, N] for an implementation name."""
    if name.startswith("mosaic"):
        from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic

        block_n = int(name.split("_b")[1]) if "_b" in name else None
        return lambda x, w, gs: grouped_matmul_mosaic(x, w, gs, block_n=block_n)
    if name in ("xla", "xla_cudnn"):
        return jax.lax.ragged_dot
    if name == "xla_triton":  # measure() sets the flag around it (read as it lowers)
        return lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)
    import tokamax

    if name == "tokamax":  # tokamax's own choice of tiles (its heuristics for this GPU)
        return lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic")
    # tokamax_mM_nN_kK: fixed tiles (block_m M rows, block_n N columns, block_k K)
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import Config

    bm, bn, bk = (int(p[1:]) for p in name.split("_")[1:])
    op = PallasMosaicGpuRaggedDot(
        config=Config(block_m=bm, block_n=bn, block_k=bk, num_stages=4, split_k=1)
    )
    return lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation=(op,))


def tile_variants(fmt: str, rows_per_expert: float, n: int) -> list[str]:
    """tokamax tile choices worth trying beside its heuristics' at decode. bf16 (its kernel
    puts rows on the wgmma's M: 64-row tiles): N and K tiles; the quantized kernel (rows on
    the wgmma's N): 16-row tiles, N tiles that divide N twice over (two compute warpgroups)."""
    if fmt == "bf16":
        return ["tokamax_m64_n32_k128", "tokamax_m64_n128_k128", "tokamax_m64_n64_k256"]
    bk = min(FORMATS[fmt] or 128, 128)
    return [f"tokamax_m16_n{bn}_k{bk}" for bn in (32, 64, 128) if n % (2 * bn) == 0][-2:]


def time_call(fn, args, iters: int) -> float:
    """Microseconds per call: `iters` calls chained inside one jitted loop (each input
    perturbed by the last output, so none is hoisted), the median of 3 timings."""

    def many(x, *rest):
        def body(_, carry):
            y = fn(x + carry, *rest)
            return (y[0, 0] * 0).astype(x.dtype)

        return jax.lax.fori_loop(0, iters, body, jnp.zeros((), x.dtype))

    compiled = jax.jit(many).lower(*args).compile()
    compiled(*args).block_until_ready()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        compiled(*args).block_until_ready()
        runs.append((time.perf_counter() - start) / iters * 1e6)
    return sorted(runs)[1]


def measure(impl: str, fmt: str, shape: str, proj: str, tokens: int, iters: int) -> dict:
    experts, d, f, top_k = SHAPES[shape]
    k, n = (d, 2 * f) if proj == "w13" else (f, d)
    key = jax.random.key(hash((shape, proj, fmt)) % 2**31)
    make = make_packed if impl.startswith("mosaic") else make_weights
    w, dense, per_expert = make(fmt, experts, k, n, key)
    sizes = routing(tokens, experts, top_k)
    x = (jax.random.normal(jax.random.fold_in(key, 2), (tokens * top_k, k)) * 0.5).astype(
        jnp.bfloat16
    )
    gs = jnp.asarray(sizes)
    fn = implementation(impl)
    flag = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
    jax.config.update(flag, impl == "xla_triton")
    try:
        out = jax.jit(fn)(x, w, gs).astype(jnp.float32)
        us = time_call(fn, (x, w, gs), iters)
    finally:
        jax.config.update(flag, False)
    ref = jax.lax.ragged_dot(x, dense, gs, preferred_element_type=jnp.float32)
    err = float(jnp.max(jnp.abs(out - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
    routed = int((sizes > 0).sum())
    return {
        "impl": impl,
        "format": fmt,
        "shape": shape,
        "proj": proj,
        "tokens": tokens,
        "rows": tokens * top_k,
        "k": k,
        "n": n,
        "routed_experts": routed,
        "us": us,
        "routed_mib": routed * per_expert / 2**20,
        "GB_per_s": routed * per_expert / us / 1e3,
        "max_rel_err": err,
    }


def summary(rows: list[dict]) -> None:
    """One line per (shape, format): each T's fastest implementation (GB/s over the routed
    experts' bytes, summed over w13 and w2) and XLA's ragged_dot beside it."""
    best: dict = {}
    for r in rows:
        if "error" in r:
            continue
        key = (r["shape"], r["format"], r["tokens"], r["impl"])
        us, mib = best.get(key, (0.0, 0.0))
        best[key] = (us + r["us"], mib + r["routed_mib"])
    for shape in dict.fromkeys(k[0] for k in best):
        for fmt in dict.fromkeys(k[1] for k in best if k[0] == shape):
            parts = []
            for t in sorted({k[2] for k in best if k[:2] == (shape, fmt)}):
                both = {k[3]: v for k, v in best.items() if k[:3] == (shape, fmt, t)}
                gbps = {i: mib * 2**20 / us / 1e3 for i, (us, mib) in both.items()}
                top = max(gbps, key=gbps.get)
                xla = f", xla {gbps['xla']:.0f}" if "xla" in gbps and top != "xla" else ""
                parts.append(f"T{t} {gbps[top]:.0f} GB/s ({top}{xla})")
            print(f"# moe {shape} {fmt}: " + "; ".join(parts))


def cases(args) -> list[tuple[str, str, str, str, int]]:
    out = []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            if fmt not in SHAPE_FORMATS[shape]:
                continue
            for impl in args.impls.split(","):
                if (impl.startswith("xla") and fmt != "bf16") or impl == "xla_cudnn":
                    continue  # XLA's ragged_dot takes bf16 only; cudnn runs in a child
                for proj in ("w13", "w2"):
                    for tokens in (int(t) for t in args.tokens.split(",")):
                        out.append((impl, fmt, shape, proj, tokens))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    parser.add_argument("--formats", default="bf16,mxfp4,fp8,int4")
    parser.add_argument("--impls", default="xla,mosaic,mosaic_b128,tokamax,xla_triton,xla_cudnn")
    parser.add_argument("--tokens", default="1,8,64,256")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        help="the measured copy rate (bench_copy_rate.py), for the fractions",
    )
    parser.add_argument(
        "--tile-sweep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also try fixed tokamax tiles beside its heuristics",
    )
    parser.add_argument("--max-seconds", type=float, default=1e9)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.copy_gbps is None and os.environ.get("COPY_RATE_JSON"):
        with open(os.environ["COPY_RATE_JSON"]) as fh:
            args.copy_gbps = json.load(fh).get("copy_gbps")
    deadline = time.monotonic() + args.max_seconds
    rows = []
    impl_cases = cases(args) if not args.child else []
    if args.child:  # xla with XLA's cuDNN ragged-dot fusion (the parent set XLA_FLAGS)
        args.impls = "xla"
        impl_cases = [("xla_cudnn", *c[1:]) for c in cases(args)]
    print(
        f"{'impl':<26}{'fmt':<7}{'shape':<15}{'proj':<5}{'T':>5}{'us':>10}{'GB/s':>9}"
        f"{'of copy':>9}  err"
    )
    expanded = []
    for impl, fmt, shape, proj, tokens in impl_cases:
        expanded.append((impl, fmt, shape, proj, tokens))
        if impl == "tokamax" and args.tile_sweep and tokens <= 8:  # decode: few rows an expert
            experts, d, f, top_k = SHAPES[shape]
            n = 2 * f if proj == "w13" else d
            for variant in tile_variants(fmt, tokens * top_k / experts, n):
                expanded.append((variant, fmt, shape, proj, tokens))
    for impl, fmt, shape, proj, tokens in expanded:
        if time.monotonic() > deadline:
            print(f"stopped: --max-seconds {args.max_seconds} reached")
            break
        try:
            row = measure(impl, fmt, shape, proj, tokens, args.iters)
        except Exception as e:  # noqa: BLE001 - recorded, the next case runs
            row = {
                "impl": impl,
                "format": fmt,
                "shape": shape,
                "proj": proj,
                "tokens": tokens,
                "error": f"{type(e).__name__}: {str(e)[:300]}",
            }
            print(f"{impl:<26}{fmt:<7}{shape:<15}{proj:<5}{tokens:>5}  {row['error'][:150]}")
            rows.append(row)
            continue
        if args.copy_gbps:
            row["of_copy_rate"] = row["GB_per_s"] / args.copy_gbps
        rows.append(row)
        frac = f"{row.get('of_copy_rate', 0):.0%}" if args.copy_gbps else "-"
        print(
            f"{impl:<26}{fmt:<7}{shape:<15}{proj:<5}{tokens:>5}{row['us']:>10.1f}"
            f"{row['GB_per_s']:>9.0f}{frac:>9}  {row['max_rel_err']:.1e}",
            flush=True,
        )
    if "xla_cudnn" in args.impls.split(",") and not args.child:
        left = deadline - time.monotonic()
        if left > 20:
            env = dict(os.environ)
            env["XLA_FLAGS"] = (
                env.get("XLA_FLAGS", "") + " --xla_gpu_experimental_use_ragged_dot_fusion=true"
            )
            child_json = (args.output_json or "/tmp/bench_moe_gmm") + ".cudnn.json"
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--shapes",
                args.shapes,
                "--formats",
                "bf16",
                "--tokens",
                args.tokens,
                "--iters",
                str(args.iters),
                "--output-json",
                child_json,
                "--max-seconds",
                str(left - 10),
                "--impls",
                "xla",
            ]
            if args.copy_gbps:
                cmd += ["--copy-gbps", str(args.copy_gbps)]
            try:
                subprocess.run(cmd, env=env, timeout=left, check=False)
                with open(child_json) as fh:
                    rows += json.load(fh)["rows"]
            except (OSError, subprocess.TimeoutExpired, ValueError) as e:
                print(f"xla_cudnn: {e}")
    summary(rows)
    if args.output_json:
        info = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "copy_gbps": args.copy_gbps,
            "rows": rows,
        }
        with open(args.output_json, "w") as fh:
            json.dump(info, fh, indent=1)


if __name__ == "__main__":
    main()
