"""One decoder projection of an 8B model (4096 -> 14336, Llama-3-8B's gate_up half) in each
checkpoint format jaxserve keeps as stored, against bf16 on the same device: the step time of
`Linear.__call__` at T tokens, and what XLA makes of it (whether the dequantization is fused
into the matmul: the optimized HLO's fusions and library calls, and the bytes it reads).

    python benchmarks/kernels/bench_quantized_linear.py --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.layers.linear import Linear

D_IN, D_OUT = 4096, 14336


def build(quant: str | None, group: int) -> Linear:
    layer = Linear(D_IN, D_OUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), quant=quant, group=group)
    key = jax.random.key(1)
    if quant == "int4":
        layer.kernel[...] = jax.random.bits(key, layer.kernel.shape, jnp.uint8)
    elif quant == "fp8_block":
        w = jax.random.normal(key, layer.kernel.shape) * 32
        layer.kernel[...] = w.astype(jnp.float8_e4m3fn)
    if layer.scale is not None:
        layer.scale[...] = jnp.full(layer.scale.shape, 0.01, jnp.float32)
    return layer


def weight_sized_temporary(hlo: str) -> bool:
    """Whether a non-library fusion writes an array of the weight's size (in x out elements,
    any shape): the dequantized (or upcast) weight written to memory and read back by the
    matmul, instead of converted inside the matmul's own fusion."""
    for dims in re.findall(
        r"= (?:bf16|f32|f16)\[([\d,]+)\]\S* fusion\(.*kind=k(?:Loop|Input)", hlo
    ):
        if math.prod(int(d) for d in dims.split(",")) == D_IN * D_OUT:
            return True
    return False


def measure(quant: str | None, group: int, tokens: int, iters: int, hlo_dir=None) -> dict:
    """`Linear` in format `quant` (None: bf16): measure_fn's row, with the group."""
    graph, state = nnx.split(build(quant, group))
    row = measure_fn(
        quant or "bf16", state, lambda s, x: nnx.merge(graph, s)(x), tokens, iters, hlo_dir
    )
    return {"group": group, **row}


def compiler_route(kind: str, group: int) -> tuple:
    """Issue 67's "compiler first" forms, outside `Linear`: the weight as XLA's own sub-byte or
    fp8 type with its scales broadcast in the expression, for XLA's sub-channel dequantisation
    fusion (`--xla_gpu_experimental_enable_subchannel_dequantisation_fusion`) or
    `jax.lax.scaled_dot` to fuse into the GEMM. Returns (params, f(params, x))."""
    key = jax.random.key(1)
    g = D_IN // group
    if kind.startswith("s4"):
        w = jax.random.randint(key, (D_IN, D_OUT), -8, 8).astype(jnp.int4)
    else:
        w = (jax.random.normal(key, (D_IN, D_OUT)) * 32).astype(jnp.float8_e4m3fn)
    s = jnp.full((g, D_OUT), 0.01, jnp.bfloat16)

    def bcast(p):
        w, s = p
        return (w.astype(jnp.bfloat16).reshape(g, group, D_OUT) * s[:, None]).reshape(D_IN, -1)

    def grouped(p, x):  # a dot per K group, the scale applied to its [T, N] partial sums
        w, s = p
        xg = x.reshape(x.shape[0], g, group)
        wg = w.astype(jnp.bfloat16).reshape(g, group, D_OUT)
        y = jnp.einsum("tgk,gkn->tgn", xg, wg, preferred_element_type=jnp.float32)
        return (y * s[None].astype(jnp.float32)).sum(1).astype(jnp.bfloat16)

    def scaled(p, x):
        w, s = p
        xs = jnp.ones((x.shape[0], g), jnp.bfloat16)
        return jax.lax.scaled_dot(
            x,
            w.astype(jnp.bfloat16),
            lhs_scale=xs,
            rhs_scale=s,
            preferred_element_type=jnp.bfloat16,
        )

    if kind.startswith("mosaic"):  # jaxserve's Mosaic GPU kernel, one group, packed.py's layout
        return _mosaic_form(kind.split("-")[1], group)
    form = kind.split("-")[1]
    fn = {"bcast": lambda p, x: x @ bcast(p), "grouped": grouped, "scaled": scaled}[form]
    return (w, s), fn


def _mosaic_form(fmt: str, group: int) -> tuple:
    """pallas_kernels/grouped_matmul/mosaic.py with one expert: the weight decoded inside the
    kernel (fmt: int4 | fp8 | mxfp4, packed.py's layout)."""
    from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic
    from pallas_kernels.grouped_matmul.packed import Packed

    key = jax.random.key(1)
    group = 32 if fmt == "mxfp4" else group
    if fmt == "fp8":
        kernel = (jax.random.normal(key, (1, D_IN, D_OUT)) * 32).astype(jnp.float8_e4m3fn)
    else:
        kernel = jax.random.bits(key, (1, D_IN // 2, D_OUT), jnp.uint8)
    shape = (1, D_IN // group, D_OUT)
    scale = jnp.full(shape, 120, jnp.uint8) if fmt == "mxfp4" else jnp.full(shape, 0.01)
    offset = jnp.zeros(shape) if fmt == "int4" else None
    w = Packed(kernel, scale, offset, group)

    def fn(w, x):
        return grouped_matmul_mosaic(x, w, jnp.full((1,), x.shape[0], jnp.int32))

    return w, fn


def measure_fn(name: str, params, fn, tokens: int, iters: int, hlo_dir=None) -> dict:
    """fn(params, x [tokens, D_IN] bf16) compiled and timed: microseconds a call, the bytes of
    params (sub-byte types at their width), what the optimized HLO holds."""
    f = jax.jit(fn)
    x = jnp.ones((tokens, D_IN), jnp.bfloat16)
    compiled = f.lower(params, x).compile()
    hlo = compiled.as_text()
    compiled(params, x).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        y = compiled(params, x)
    y.block_until_ready()
    us = (time.perf_counter() - start) / iters * 1e6
    weight_bytes = sum(
        v.size
        * (4 if v.dtype.name in ("int4", "uint4", "float4_e2m1fn") else v.dtype.itemsize * 8)
        // 8
        for v in jax.tree.leaves(params)
    )
    if hlo_dir:
        with open(f"{hlo_dir}/{name}-t{tokens}.hlo.txt", "w") as fh:
            fh.write(hlo)
    return {
        "format": name,
        "tokens": tokens,
        "us": us,
        "weight_mib": weight_bytes / 2**20,
        "GB_per_s": weight_bytes / us / 1e3,
        "fusions": len(re.findall(r"^\s*\S+ = \S+ fusion\(", hlo, re.M)),
        "library_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
        # an [in, out] array written between two kernels (a dequantized or upcast weight)?
        "weight_sized_temporary": weight_sized_temporary(hlo),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--hlo-dir", default=None, help="write each optimized HLO there")
    parser.add_argument(
        "--compiler-forms",
        default="",
        help="also these forms outside Linear, e.g. s4-bcast,s4-grouped,f8-bcast,f8-scaled, "
        "and jaxserve's Mosaic GPU kernel: mosaic-int4,mosaic-fp8,mosaic-mxfp4",
    )
    args = parser.parse_args()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        base = None
        for quant, group in ((None, 0), ("fp8_block", 128), ("int4", 128)):
            row = measure(quant, group, tokens, args.iters, args.hlo_dir)
            base = base or row  # bf16 first
            row["speed_vs_bf16"] = base["us"] / row["us"]
            rows.append(row)
            print(json.dumps(row))
        for kind in filter(None, args.compiler_forms.split(",")):
            try:
                params, fn = compiler_route(kind, 128)
                row = measure_fn(kind, params, fn, tokens, args.iters, args.hlo_dir)
                row["speed_vs_bf16"] = base["us"] / row["us"]
            except Exception as e:  # a form this XLA cannot compile: recorded, not fatal
                row = {"format": kind, "tokens": tokens, "error": f"{type(e).__name__}: {e}"[:400]}
            rows.append(row)
            print(json.dumps(row))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "device": str(jax.devices()[0].device_kind),
                    "jax": jax.__version__,
                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
