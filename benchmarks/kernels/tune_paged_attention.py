"""A sweep of the Pallas paged-attention kernel's tuning arguments on the GPU, timed as
bench_paged_attention.py times the kernel (jitted chains, rotated cache copies), to choose its
defaults from measurements rather than guesses.

Three sweeps, most important first (each row is printed as it is measured, so a run cut short
by --max-seconds or a timeout still reports what it had):

1. decode tile at batch 256, context 8192 (the >= 85%-of-HBM case), unsplit: KV tokens per
   inner step x Triton pipeline stages x warps, where the tiling fits shared memory;
2. KV splits at small batches, default tile: decode at 1 x 8192 (then 16 x 2048 and 64 x
   8192, last), the mixed kernel's on one 4-token verification over 8192 keys;
3. mixed kernel at one 512-token chunk beside 255 decodes, context 8192: q_block x KV tokens
   per step x warps of the mixed kernel.

Each row shows the time per call, the fraction of the HBM peak (K/V bytes of the context) and
the speed against the configuration the kernel picks by itself today (its defaults: the first
row of each case); the best configuration per case closes it ("# best ...").

    python benchmarks/kernels/tune_paged_attention.py --output-json tune.json
    python benchmarks/kernels/tune_paged_attention.py --smoke   # tiny, interpret mode, CPU
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import jax
import jax.numpy as jnp
from bench_paged_attention import make_batch, peak_bandwidth, seconds_per_call

from pallas_kernels.paged_attention import ragged_paged_attention

HEADER = (
    "| kernel | case | KV tokens/step | q_block | stages | warps | splits | us | of peak "
    "| vs default |"
)


def sweeps(smoke: bool) -> list[tuple[str, list[tuple[int, int]], list[dict]]]:
    """(case name, seqs [(q_len, kv_len)], configurations; the first is the default)."""
    if smoke:
        decode = [(1, 40)] * 2
        tiles = [{}, dict(decode_pages_per_step=1, num_stages=3, num_warps=8)]
        return [
            ("decode b=2 ctx=40", decode, tiles),
            ("decode b=2 ctx=40", decode, [{}, dict(num_kv_splits=2)]),
            ("mixed 1x8-chunk + 1 decodes ctx=40", [(8, 40), (1, 40)],
             [{}, dict(q_block=16, prefill_kv_tokens_per_step=16)]),
        ]  # fmt: skip
    tiles = [{}] + [
        dict(decode_pages_per_step=tokens // 16, num_stages=stages, num_warps=warps)
        for tokens, stages, warps in itertools.product((128, 64, 32), (2, 3, 4), (4, 8))
    ]
    splits = [{}] + [dict(num_kv_splits=s) for s in (1, 2, 4, 8, 16, 32, 64)]
    mixed = [{}] + [
        dict(q_block=q, prefill_kv_tokens_per_step=t, num_warps=w)
        for q, t, w in itertools.product((64, 128), (32, 64, 128), (4, 8))
    ]
    verify = [{}] + [dict(mixed_kv_splits=s) for s in (1, 4, 16, 64)]
    return [
        ("decode b=256 ctx=8192", [(1, 8192)] * 256, [{**t, "num_kv_splits": 1} for t in tiles]),
        ("decode b=1 ctx=8192", [(1, 8192)], splits),
        ("mixed 1x4-token verification ctx=8192", [(4, 8192)], verify),
        ("mixed 1x512-chunk + 255 decodes ctx=8192", [(512, 8192)] + [(1, 8192)] * 255, mixed),
        ("decode b=16 ctx=2048", [(1, 2048)] * 16, splits),
        ("decode b=64 ctx=8192", [(1, 8192)] * 64, splits),
    ]


def _cell(config: dict, key: str, scale: int = 1) -> str:
    return str(config[key] * scale) if key in config else "default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--max-seconds", type=float, default=240.0,
                        help="stop starting configurations after this long")  # fmt: skip
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    hq, hkv, d, bs = (4, 2, 64, 16) if args.smoke else (32, 8, 128, 16)
    dtype = jnp.dtype(jnp.bfloat16)
    timing = dict(chain_s=0.0 if args.smoke else 0.02, warmup=1, iters=2 if args.smoke else 3)
    rotate = 1 if args.smoke else 256 * 2**20
    device = jax.devices()[0]
    peak = peak_bandwidth(device)
    print(f"# {device.device_kind} ({device.platform}), jax {jax.__version__}; Hq={hq} Hkv={hkv} "
          f"D={d} block={bs} {dtype.name}")  # fmt: skip
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|---|---|")
    start = time.monotonic()
    results = []
    for case, seqs, configs in sweeps(args.smoke):
        kv_bytes = sum(-(-kv // bs) * bs for _, kv in seqs) * 2 * hkv * d * dtype.itemsize
        copies = max(1, min(2 if args.smoke else 256, -(-rotate // kv_bytes)))
        batch = make_batch(seqs, hq=hq, hkv=hkv, head_dim=d, block_size=bs, dtype=dtype,
                           copies=copies)  # fmt: skip
        decode_only = all(q == 1 for q, _ in seqs)
        default_us, best = None, None
        for config in configs:
            if time.monotonic() - start > args.max_seconds:
                print(f"# stopped: --max-seconds {args.max_seconds:.0f} reached", flush=True)
                break
            fn = functools.partial(
                ragged_paged_attention, sm_scale=d**-0.5, decode_only=decode_only,
                interpret=args.smoke, **config,
            )  # fmt: skip
            try:
                seconds, _ = seconds_per_call(fn, tuple(batch.values()), copies=copies, **timing)
            except ValueError as e:  # a tiling that does not fit shared memory
                print(f"# skipped {case} {config}: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            us = seconds * 1e6
            default_us = default_us or us
            row = dict(case=case, config=config, us=us, vs_default=default_us / us,
                       hbm_fraction=kv_bytes / seconds / peak if peak else None)  # fmt: skip
            results.append(row)
            best = row if best is None or us < best["us"] else best
            cells = [
                "decode" if decode_only else "mixed", case.split(" ", 1)[1],
                _cell(config, "decode_pages_per_step", bs) if decode_only
                else _cell(config, "prefill_kv_tokens_per_step"),
                "-" if decode_only else _cell(config, "q_block"), _cell(config, "num_stages"),
                _cell(config, "num_warps"),
                _cell(config, "num_kv_splits" if decode_only else "mixed_kv_splits"),
                f"{us:.1f}",
                f"{row['hbm_fraction']:.0%}" if peak else "-", f"{row['vs_default']:.2f}x",
            ]  # fmt: skip
            print("| " + " | ".join(cells) + " |", flush=True)
        if best is not None:
            frac = f" ({best['hbm_fraction']:.0%} of peak)" if peak else ""
            print(f"# best {case}: {best['config'] or 'the defaults'}: {best['us']:.1f} us{frac}, "
                  f"{best['vs_default']:.2f}x the defaults", flush=True)  # fmt: skip
        del batch
        if args.output_json:  # after every case: a cut-short run keeps what it measured
            with open(args.output_json, "w") as f:
                json.dump(dict(device=device.device_kind, jax=jax.__version__, results=results),
                          f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
