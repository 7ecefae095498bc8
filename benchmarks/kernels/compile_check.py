"""Compile every Mosaic GPU kernel (and the Triton attention kernel) for an H100 at the shapes
the GPU suite runs, without a GPU: each case lowered and compiled through XLA's whole GPU
pipeline (PTX included) for the deviceless target of jaxserve/benchmarks/kernel_count.py, or
for the local GPU where there is one. A kernel that lowers (the suite's `cuda_lowering` tests)
can still fail Mosaic GPU's layout inference or PTX generation; this finds those failures
before a lent GPU's minutes are spent on them.

    # jax >= 0.11 with its CUDA plugin (pip install "jax[cuda13]==0.11.2"), no GPU needed:
    JAX_PLATFORMS=cpu python benchmarks/kernels/compile_check.py [--only moe] [--output-json F]

Prints a line per case: ok (kernels in the optimized HLO, compile seconds) or the error's
first line; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxserve.benchmarks.kernel_count import count, cuda_devices

S = jax.ShapeDtypeStruct
BF16, I32, U8 = jnp.bfloat16, jnp.int32, jnp.uint8


def _packed(fmt: str, g: int, k: int, n: int):
    """A Packed stack's arrays as shapes (pallas_kernels/grouped_matmul/packed.py's layout)."""
    from pallas_kernels.grouped_matmul.packed import Packed

    group = {"int4": 128, "fp8_block": 128, "mxfp4": 32, "gguf": 32}[fmt]
    rows = k // 2 if fmt in ("int4", "mxfp4") else k
    code = {"int4": U8, "mxfp4": U8, "fp8_block": jnp.float8_e4m3fn, "gguf": jnp.int8}[fmt]
    scale = S((g, k // group, n), U8 if fmt == "mxfp4" else jnp.float32)
    offset = S((g, k // group, n), jnp.float32) if fmt in ("int4", "gguf") else None
    return Packed(S((g, rows, n), code), scale, offset, group)


def moe_cases() -> dict[str, tuple[Callable, tuple]]:
    """The grouped matmul kernel (grouped_matmul/mosaic.py) per format at gpt-oss-20b's and
    Qwen3-30B-A3B's projections, decode (top-k rows of 1 and 32 tokens) and 256 tokens; the
    8B's projections with one group (issue 67's packed Linear)."""
    from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic

    shapes = {  # name: (experts, K, N, top-k)
        "gpt-oss-20b w13": (32, 2880, 5760, 4),
        "gpt-oss-20b w2": (32, 2880, 2880, 4),
        "qwen3-30b-a3b w13": (128, 2048, 1536, 8),
        "qwen3-30b-a3b w2": (128, 768, 2048, 8),
        "llama-3-8b qkv": (1, 4096, 6144, 1),
        "llama-3-8b down": (1, 14336, 4096, 1),
    }
    formats = {
        "gpt-oss-20b": ("dense", "mxfp4"),
        "qwen3-30b-a3b": ("dense", "fp8_block", "int4", "mxfp4"),
        "llama-3-8b": ("int4", "fp8_block", "mxfp4", "gguf"),
    }
    cases = {}
    for name, (g, k, n, top) in shapes.items():
        for fmt in formats[name.split()[0]]:
            w = S((g, k, n), BF16) if fmt == "dense" else _packed(fmt, g, k, n)
            for tokens in (1, 32, 256):
                args = (S((tokens * top, k), BF16), w, S((g,), I32))
                cases[f"moe {name} {fmt} T={tokens}"] = (grouped_matmul_mosaic, args)
    return cases


def attention_cases() -> dict[str, tuple[Callable, tuple]]:
    """The paged-attention kernels (Mosaic GPU and Triton) at the 8B's heads (32 / 8, D 128)
    and gpt-oss's (64 / 8, D 64, sinks, a sliding window): decode of 256 sequences (Mosaic's
    direct path), of 1 long sequence (split), a mixed step."""
    from pallas_kernels.paged_attention.kernel import ragged_paged_attention as triton
    from pallas_kernels.paged_attention.mosaic import ragged_paged_attention as mosaic

    cases = {}
    for model, (hq, hkv, d, sinks, window) in {
        "8b": (32, 8, 128, False, None),
        "gpt-oss": (64, 8, 64, True, 128),
    }.items():
        for step, (tokens, seqs, decode) in {
            "decode b=256": (256, 256, True),
            "decode b=1": (1, 1, True),
            "mixed 512": (512, 64, False),
        }.items():
            blocks, bs, max_blocks = 4096, 16, 256
            cache = S((blocks, bs, hkv, d), BF16)
            args = (
                S((tokens, hq, d), BF16),
                cache,
                cache,
                S((seqs,), I32),
                S((seqs, max_blocks), I32),
                S((seqs + 1,), I32),
                S((1,), I32),
                S((hq,), BF16) if sinks else None,
            )
            for name, fn in (("mosaic", mosaic), ("triton", triton)):
                kw = dict(sm_scale=d**-0.5, sliding_window=window, decode_only=decode)
                cases[f"attention {name} {model} {step}"] = (functools.partial(fn, **kw), args)
        blocks_args = (*args[:8], S((2,), I32))  # the Mosaic kernel's block_map
        kw = dict(sm_scale=d**-0.5, sliding_window=window, decode_only=True)
        cases[f"attention mosaic {model} block_map"] = (
            functools.partial(mosaic, **kw),
            blocks_args,
        )
    return cases


def sparse_mla_cases() -> dict[str, tuple[Callable, tuple]]:
    """DeepSeek-V3.2's sparse attention over chosen tokens and the indexer's scores
    (pallas_kernels/sparse_mla) at the published widths (576-wide latents, 16 heads a device
    at tp 8, top-k 2048; the indexer's 64 heads of 128)."""
    from pallas_kernels.sparse_mla.indexer import index_logits
    from pallas_kernels.sparse_mla.mosaic import sparse_mla

    cases = {}
    for tokens in (1, 32):
        args = (S((tokens, 16, 576), BF16), S((2048, 64, 1, 576), BF16), S((tokens, 2048), I32))
        cases[f"sparse_mla T={tokens}"] = (
            functools.partial(sparse_mla, sm_scale=0.1, latent_dim=512),
            args,
        )
        index_args = (
            S((tokens, 64, 128), BF16),
            S((tokens, 64), jnp.float32),
            S((2048, 64, 1, 128), BF16),
            S((tokens, 512), I32),
            S((tokens,), I32),
        )
        cases[f"sparse_mla indexer T={tokens}"] = (index_logits, index_args)
    return cases


GROUPS = {"moe": moe_cases, "attention": attention_cases, "sparse_mla": sparse_mla_cases}


def compile_case(fn: Callable, args: tuple, device) -> str:
    """The optimized HLO of jit(fn)(*args) compiled for `device` (args: ShapeDtypeStructs or
    pytrees of them, None kept)."""
    sharding = SingleDeviceSharding(device)
    placed = jax.tree.map(lambda a: S(a.shape, a.dtype, sharding=sharding), args)
    # jax 0.11's Triton lowering reads the target's compute capability from the default device
    with jax.default_device(device):
        lowered = jax.jit(fn).lower(*placed)
    return lowered.compile().as_text()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=None, help=f"one of {sorted(GROUPS)}")
    parser.add_argument("--match", default="", help="only cases whose name contains this")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    devices, how = cuda_devices()
    if not devices:
        raise SystemExit(f"compile_check: {how}")
    print(f"# compiling for: {how} ({devices[0].device_kind}), jax {jax.__version__}")
    results = {}
    for group, make in GROUPS.items():
        if args.only and group != args.only:
            continue
        for name, (fn, case_args) in make().items():
            if args.match not in name:
                continue
            start = time.perf_counter()
            try:
                hlo = compile_case(fn, case_args, devices[0])
                kernels = sum(count(hlo).values())
                line = f"ok ({kernels} kernels, {time.perf_counter() - start:.1f} s)"
                results[name] = {"ok": True, "kernels": kernels}
            except Exception as e:  # every failure is reported; the run goes on
                first = (str(e).strip().splitlines() or [""])[0][:300]
                line = f"FAILED {type(e).__name__}: {first}"
                results[name] = {"ok": False, "error": f"{type(e).__name__}: {first}"}
            print(f"{name:60s} {line}", flush=True)
    failed = [n for n, r in results.items() if not r["ok"]]
    print(f"# {len(results) - len(failed)} of {len(results)} compiled ({how})")
    out = {"where": how, "jax": jax.__version__, "cases": results}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    if failed:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
