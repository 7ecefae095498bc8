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
    layer = build(quant, group)
    graph, state = nnx.split(layer)
    f = jax.jit(lambda s, x: nnx.merge(graph, s)(x))
    x = jnp.ones((tokens, D_IN), jnp.bfloat16)
    compiled = f.lower(state, x).compile()
    hlo = compiled.as_text()
    compiled(state, x).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        y = compiled(state, x)
    y.block_until_ready()
    us = (time.perf_counter() - start) / iters * 1e6
    weight_bytes = sum(v.nbytes for v in jax.tree.leaves(state))
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", hlo, re.M))
    # an [in, out] array written between two kernels (a dequantized or upcast weight)?
    materialized = weight_sized_temporary(hlo)
    if hlo_dir:
        with open(f"{hlo_dir}/{quant or 'bf16'}-t{tokens}.hlo.txt", "w") as f:
            f.write(hlo)
    return {"format": quant or "bf16", "group": group, "tokens": tokens, "us": us,
            "weight_mib": weight_bytes / 2**20, "GB_per_s": weight_bytes / us / 1e3,
            "fusions": fusions, "library_calls": calls,
            "weight_sized_temporary": materialized}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--hlo-dir", default=None, help="write each optimized HLO there")
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
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
