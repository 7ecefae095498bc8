"""Ragged paged attention: the Pallas kernels against their peers, measured in the same run.

Two kernels of ours (--kernels, default both): `triton` (pallas_kernels.paged_attention.kernel,
Pallas' Triton backend) and `mosaic` (pallas_kernels.paged_attention.mosaic, Mosaic GPU), same
positional signature; a kernel that cannot be imported is reported as
`# mosaic: unavailable (<reason>)` and left out, and a case one fails is reported as
`# mosaic failed on <case>: <reason>`, the rest going on. Each table row is one kernel on one
case.

Llama-3-8B head shapes by default (32 query heads, 8 KV heads, head_dim 128, bf16, block 16),
one layer's KV cache. For each decode case (batch x context) it prints the kernel's time, its
achieved HBM bandwidth (K/V bytes read / time) as a fraction of the device's peak, and its
speed-up over (a) the jnp reference under XLA and (b) jax's own decode-only Pallas kernel
`jax.experimental.pallas.ops.gpu.paged_attention` (on its own cache layout, built outside the
timed region). Mixed cases (one prefill chunk beside decodes) compare with the reference only.
The end-to-end shape comes first: the decode step of the GPU suite's 256-prompt run, batch
--e2e-batch (256; 0: none) at contexts spread evenly over --e2e-contexts (33 to 160, the
suite's 32-token prompts over their 128 outputs).

Blocks are assigned from a shuffled pool (non-contiguous, as in serving). Timing is of the
kernels, not of dispatch: each implementation runs as one jitted chain of n calls (each call's
output is the next call's query, so none can be hoisted, merged or overlapped), n picked so a
chain takes about --chain-ms; the time per call is (chain of n - chain of 1) / (n - 1), both
medians over --iters runs, so the one dispatch per chain cancels. The cache holds R copies of
the batch's blocks and call i reads copy i mod R (its own block table), the R copies at least
--rotate-mb together, so the 50 MB L2 holds none of a call's K/V when it starts. Bandwidth
counts the K/V bytes of the context (whole pages, each read once per KV head).

    python benchmarks/kernels/bench_paged_attention.py --output-json out.json
    python benchmarks/kernels/bench_paged_attention.py --smoke   # tiny, interpret mode, CPU

MLA (DeepSeek's latent attention, absorbed form; `--mla-latent` its kv_lora_rank): one cache
head of [latent; rotary key] per token, read once as keys and values, so the bytes counted
are one head of head_dim per token; the output is the latent, and each chained call's query
keeps the previous query's rotary columns. DeepSeek-V3 on a tp-8 rank:

    python benchmarks/kernels/bench_paged_attention.py --mla-latent 512 --head-dim 576 \
        --num-q-heads 16 --num-kv-heads 1
"""

from __future__ import annotations

import argparse
import functools
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.benchmarks.common import median_seconds
from pallas_kernels.paged_attention import ragged_paged_attention_reference

KERNELS = ("triton", "mosaic")


def load_kernels(names) -> tuple[dict, dict[str, str]]:
    """({name: ragged_paged_attention} of the kernels that import, {name: why not} of the
    rest)."""
    kernels, unavailable = {}, {}
    for name in names:
        try:
            if name == "triton":
                from pallas_kernels.paged_attention import pallas_unavailable_message
                from pallas_kernels.paged_attention import ragged_paged_attention as fn

                if (why := pallas_unavailable_message()) is not None:
                    raise ImportError(why)
            elif name == "mosaic":
                from pallas_kernels.paged_attention.mosaic import ragged_paged_attention as fn
            else:
                raise ValueError(f"unknown kernel {name!r} (known: {', '.join(KERNELS)})")
        except Exception as e:  # noqa: BLE001 (any failure: recorded, the others run)
            unavailable[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        kernels[name] = fn
    return kernels, unavailable


# Peak HBM bandwidth (bytes/s) by jax device_kind prefix: vendor data sheets.
PEAK_BANDWIDTH = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100": 3.35e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100": 1.555e12,
}


def peak_bandwidth(device) -> float | None:
    for prefix, bw in PEAK_BANDWIDTH.items():
        if device.device_kind.startswith(prefix):
            return bw
    return None


def make_batch(seqs, *, hq, hkv, head_dim, block_size, dtype, copies=1, seed=0):
    """seqs: (q_len, kv_len) per sequence -> the kernel's arguments (device arrays), with
    block_tables [copies, S, max_blocks]: copy r's table points at its own blocks."""
    rng = np.random.default_rng(seed)
    blocks = [-(-kv // block_size) for _, kv in seqs]
    max_blocks = max(blocks)
    per_copy = sum(blocks) + 1
    tables = np.zeros((copies, len(seqs), max_blocks), np.int32)
    for r in range(copies):
        perm = r * per_copy + rng.permutation(per_copy).astype(np.int32)
        used = 0
        for i, n in enumerate(blocks):
            tables[r, i, :n] = perm[used : used + n]
            used += n
    num_tokens = sum(q for q, _ in seqs)
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    cache_shape = (copies * per_copy, block_size, hkv, head_dim)
    return dict(
        q=jax.random.normal(kq, (num_tokens, hq, head_dim), dtype),
        k_cache=jax.random.normal(kk, cache_shape, dtype),
        v_cache=jax.random.normal(kv, cache_shape, dtype),
        kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
        block_tables=jnp.asarray(tables),
        query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
    )


def chain(fn, n: int, copies: int):
    """jit of n calls of fn(q, k, v, kv_lens, tables, ...) -> q' in a row: call i reads
    block-table copy i mod copies and takes call i-1's output as its query."""

    def run(q, k, v, kv_lens, tables, *rest):
        for i in range(n):
            q = fn(q, k, v, kv_lens, tables[i % copies], *rest)
        return q

    return jax.jit(run)


def seconds_per_call(fn, args, *, copies, chain_s, warmup, iters, max_calls=32):
    """Kernel time of one fn call, and the jitted one-call chain (call it for an output).

    Chains of 1 and n calls (n from the first's time, so a chain takes about chain_s; 2 to
    max_calls) are timed whole; their difference over n - 1 calls is the time per call,
    without the one dispatch and synchronisation each chain pays."""
    one = chain(fn, 1, copies)
    t_one = median_seconds(one, *args, warmup=warmup, iters=iters)
    n = int(min(max_calls, max(2, round(chain_s / t_one))))
    t_n = median_seconds(chain(fn, n, copies), *args, warmup=warmup, iters=iters)
    per_call = (t_n - t_one) / (n - 1)
    return (per_call if per_call > 0 else t_n / n), one  # noise beyond the difference: t_n/n


def jax_paged_attention():
    """jax's own decode kernel, or None in a jax without it (its Pallas Triton ops are
    deprecated after 0.11)."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except ImportError:
        return None
    return paged_attention


def jax_decode_peer(batch, *, interpret=False):
    """jax.experimental.pallas.ops.gpu.paged_attention on its [Hkv, pages, page, D] layout:
    (fn(q, k_pages, v_pages, kv_lens, tables) -> out, its arguments)."""
    paged_attention = jax_paged_attention()
    k_pages = jnp.transpose(batch["k_cache"], (2, 0, 1, 3))
    v_pages = jnp.transpose(batch["v_cache"], (2, 0, 1, 3))
    tables = batch["block_tables"]
    k_splits = 16 if tables.shape[-1] >= 16 else 1
    pad = -tables.shape[-1] % (k_splits * 8)  # pages per split divisible by its compute block
    tables = jnp.pad(tables, ((0, 0), (0, 0), (0, pad)))

    def fn(q, k_pages, v_pages, kv_lens, tables):
        return paged_attention(
            q, k_pages, v_pages, tables, kv_lens, k_splits=k_splits, interpret=interpret
        )

    return fn, (batch["q"], k_pages, v_pages, batch["kv_lens"], tables)


def run_case(name, seqs, args, results, kernels: dict, failures: dict):
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    dtype = jnp.dtype(args.dtype)
    latent = args.mla_latent
    heads_read = hkv if latent else 2 * hkv  # MLA: the latent is both key and value
    kv_bytes = sum(-(-kv // bs) * bs for _, kv in seqs) * heads_read * d * dtype.itemsize
    copies = max(1, min(args.max_copies, -(-args.rotate_mb * 2**20 // kv_bytes)))
    batch = make_batch(seqs, hq=hq, hkv=hkv, head_dim=d, block_size=bs, dtype=dtype,
                       copies=copies)  # fmt: skip
    inputs = tuple(batch.values())
    scale = d**-0.5
    decode_only = all(q == 1 for q, _ in seqs)  # as the model runner says: the decode kernel
    reference = functools.partial(
        ragged_paged_attention_reference, sm_scale=scale, decode_only=decode_only
    )
    if latent:  # the latent output, then the query's rotary columns: the next call's query
        reference = _latent_chained(reference, latent)
    timing = dict(copies=copies, chain_s=args.chain_ms / 1e3, warmup=args.warmup,
                  iters=args.iters)  # fmt: skip
    # The reference is an XLA graph n times over (slow to compile) and slow enough for a few.
    t_ref, reference_one = seconds_per_call(reference, inputs, **timing, max_calls=4)
    want = reference_one(*inputs).astype(jnp.float32)  # one call, table copy 0
    peer = {}
    if decode_only and not latent and jax_paged_attention() is not None:
        fn, peer_args = jax_decode_peer(batch, interpret=args.smoke)
        t_peer, peer_one = seconds_per_call(fn, peer_args, **timing)
        q_scaled = (peer_args[0].astype(jnp.float32) * scale).astype(dtype)  # it has no scale
        out = peer_one(q_scaled, *peer_args[1:]).astype(jnp.float32)
        peer = dict(jax_pallas_us=t_peer * 1e6,
                    jax_pallas_max_abs_err=float(jnp.max(jnp.abs(out - want))))  # fmt: skip
        del peer_args
    peak = peak_bandwidth(jax.devices()[0])
    for kernel_name, attention in kernels.items():
        kernel = functools.partial(
            attention, sm_scale=scale, decode_only=decode_only, interpret=args.smoke,
            **(dict(latent_dim=latent) if latent else {}),
        )  # fmt: skip
        if latent:
            kernel = _latent_chained(kernel, latent)
        try:
            t_kernel, kernel_one = seconds_per_call(kernel, inputs, **timing)
            out = kernel_one(*inputs).astype(jnp.float32)
        except Exception as e:  # noqa: BLE001 (recorded; the other kernels and cases go on)
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            failures.setdefault(kernel_name, {})[name] = why
            print(f"# {kernel_name} failed on {name}: {why}", flush=True)
            continue
        err = float(jnp.max(jnp.abs(out - want)))
        row = dict(case=name, kernel=kernel_name, kernel_us=t_kernel * 1e6,
                   reference_us=t_ref * 1e6, max_abs_err=err, kv_bytes=kv_bytes,
                   cache_copies=copies, achieved_gbps=kv_bytes / t_kernel / 1e9,
                   **peer)  # fmt: skip
        if peak:
            row["hbm_fraction"] = kv_bytes / t_kernel / peak
        results.append(row)
        print(_format(row), flush=True)


def e2e_contexts(batch: int, low: int, high: int) -> list[int]:
    """batch context lengths spread evenly from low to high (both included)."""
    if batch == 1:
        return [high]
    return [low + (high - low) * i // (batch - 1) for i in range(batch)]


def _latent_chained(fn, latent: int):
    """MLA: fn(q, k, v, ...) -> [T, Hq, latent] made q-wide (its output's latent columns, then
    q's rotary ones), so calls chain."""

    def call(q, k, v, *rest):
        out = fn(q, k, k, *rest)[..., :latent]
        return jnp.concatenate([out, q[..., latent:]], axis=-1)

    return call


def _format(row) -> str:
    cells = [
        row["case"],
        row["kernel"],
        f"{row['kernel_us']:.1f}",
        f"{row['achieved_gbps']:.0f}",
        f"{row['hbm_fraction']:.0%}" if "hbm_fraction" in row else "-",
        f"{row['reference_us'] / row['kernel_us']:.2f}x",
        f"{row['jax_pallas_us'] / row['kernel_us']:.2f}x" if "jax_pallas_us" in row else "-",
        f"{row['max_abs_err']:.1e}",
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5, help="timed runs of each chain")
    parser.add_argument("--chain-ms", type=float, default=20.0,
                        help="about how long a timed chain of calls runs")  # fmt: skip
    parser.add_argument("--rotate-mb", type=int, default=256,
                        help="the cache copies calls rotate over total at least this")  # fmt: skip
    parser.add_argument("--max-copies", type=int, default=256)
    parser.add_argument("--mla-latent", type=int, default=None,
                        help="MLA: kv_lora_rank (head_dim: it + the rotary width)")  # fmt: skip
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help="comma-separated: triton, mosaic")  # fmt: skip
    parser.add_argument("--e2e-batch", type=int, default=256,
                        help="the end-to-end decode case's batch (0: none)")  # fmt: skip
    parser.add_argument("--e2e-contexts", type=int, nargs=2, default=[33, 160],
                        metavar=("LOW", "HIGH"))  # fmt: skip
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes in interpret mode (CPU; format check)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        # (Mosaic GPU's interpreter takes ~0.1 s a call: few cases, one timed run each)
        args.batch_sizes, args.contexts = [2], [40]
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.warmup, args.iters, args.chain_ms = 1, 1, 0.0
        args.rotate_mb, args.max_copies = 1, 2  # two copies: the rotation runs too
        args.e2e_batch, args.e2e_contexts = min(args.e2e_batch, 3), [33, 40]
        if args.mla_latent:  # one decode case and one mixed: the path, not a sweep
            args.num_q_heads, args.num_kv_heads, args.head_dim, args.mla_latent = 4, 1, 80, 64
            args.batch_sizes = [1]
    if args.mla_latent:
        args.e2e_batch = 0  # a Llama-3 shape
    kernels, unavailable = load_kernels([k for k in args.kernels.split(",") if k])

    device = jax.devices()[0]
    print(f"# {device.device_kind} ({device.platform}), jax {jax.__version__}, "
          f"{platform.machine()}; Hq={args.num_q_heads} Hkv={args.num_kv_heads} "
          f"D={args.head_dim} block={args.block_size} {args.dtype}"
          + (f"; MLA, latent {args.mla_latent}" if args.mla_latent else ""))  # fmt: skip
    peak = peak_bandwidth(device)
    print(f"# peak HBM bandwidth: {peak / 1e12:.2f} TB/s" if peak else "# peak bandwidth: unknown")
    if jax_paged_attention() is None:
        print(f"# jax {jax.__version__} has no jax.experimental.pallas.ops.gpu.paged_attention: "
              "no peer column")  # fmt: skip
    for name, why in unavailable.items():
        print(f"# {name}: unavailable ({why})")
    print(f"# kernels: {', '.join(kernels) or 'none'}")
    print("| case | kernel | kernel us | KV GB/s | of peak | vs XLA reference | "
          "vs jax Pallas decode | max abs err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    results: list[dict] = []
    failures: dict[str, dict[str, str]] = {}
    cases = []
    if args.e2e_batch:
        low, high = args.e2e_contexts
        ctxs = e2e_contexts(args.e2e_batch, low, high)
        cases.append((f"decode b={args.e2e_batch} ctx={low}-{high} (e2e)", [(1, c) for c in ctxs]))
    for ctx in args.contexts:
        for b in args.batch_sizes:
            cases.append((f"decode b={b} ctx={ctx}", [(1, ctx)] * b))
    for ctx in args.contexts:
        b = args.batch_sizes[-1]
        chunk = min(512, ctx)
        cases.append((f"mixed 1x{chunk}-chunk + {b - 1} decodes ctx={ctx}",
                      [(chunk, ctx)] + [(1, ctx)] * (b - 1)))  # fmt: skip
    for name, seqs in cases:
        if kernels:
            run_case(name, seqs, args, results, kernels, failures)
        if args.output_json:  # after every case: a run cut short keeps what it measured
            with open(args.output_json, "w") as f:
                json.dump(dict(device=device.device_kind, jax=jax.__version__, args=vars(args),
                               kernels=list(kernels), unavailable=unavailable,
                               failures=failures, results=results), f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
