"""Sparse MLA (DeepSeek Sparse Attention's attention half): the Mosaic GPU kernel's bandwidth
over the chosen tokens' bytes against dense MLA's over the whole context, in the same run.

DeepSeek-V3.2's widths: one cached head of 512 latent + 64 rotary values a token (bf16,
1152 B), top-k 2048, 64-token pages; the query heads of one device (--heads: 16 at tp 8,
128 at tp 1); decodes of --batches sequences at --context tokens each. Per case:

- sparse_mosaic: pallas_kernels.sparse_mla.mosaic.sparse_mla, each query over 2048 distinct
  random tokens of its context; bytes = batch x top-k x 1152 (each listed row once; the
  second value half's read is not counted: it comes mostly from L2);
- sparse_xla: the jnp reference (XLA's gather and dots) on the same lists and bytes;
- dense_triton: the Triton MLA kernel (pallas_kernels.paged_attention.kernel, latent_dim 512)
  over the whole context; bytes = batch x context x 1152;
- indexer_mosaic / indexer_xla (once per batch: the indexer's 64 heads are not split): the
  lightning indexer's scores over the whole context (pallas_kernels.sparse_mla.indexer, its
  jnp reference), from an index-key cache of 128 values a token; bytes = batch x context x
  256. The top-k after them is not timed.

Each row: time per call, GB/s of those bytes, and the fraction of the device-to-device copy
rate (--copy-gbps, or COPY_RATE_JSON from benchmarks/bench_copy_rate.py) and of the
datasheet peak. Timing as bench_paged_attention.py's: jitted chains of 1 and n calls, each
call's output the next call's query, the difference over n - 1; call i reads copy i mod R of
the cache (R copies of >= --rotate-mb together), so the L2 holds none of a call's rows when
it starts. The summary line `# sparse ...` gives the issue's figure: sparse_mosaic's fraction
of the copy rate against dense_triton's.

    python benchmarks/kernels/bench_sparse_mla.py --output-json out.json
    python benchmarks/kernels/bench_sparse_mla.py --smoke   # tiny, interpret mode, CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged_attention import peak_bandwidth  # noqa: E402

from jaxserve.benchmarks.common import median_seconds  # noqa: E402
from pallas_kernels.sparse_mla.reference import (  # noqa: E402
    index_logits_reference,
    sparse_mla_reference,
)

LATENT, ROPE, BLOCK = 512, 64, 64
HEAD = LATENT + ROPE
INDEX_HEADS, INDEX_DIM = 64, 128


def make_case(batch, context, topk, heads, copies, seed=0):
    """q [B, H, 576], a cache of `copies` disjoint regions of B contexts each, per copy the
    slots of each query's top-k list [copies, B, k] and its block tables [copies, B, blocks]."""
    rng = np.random.default_rng(seed)
    per_seq = -(-context // BLOCK)
    tables = np.arange(copies * batch * per_seq, dtype=np.int32).reshape(copies, batch, per_seq)
    tables = rng.permuted(tables, axis=2)  # non-contiguous pages, as in serving
    slots = np.empty((copies, batch, topk), np.int32)
    for c in range(copies):
        for b in range(batch):
            idx = rng.choice(context, topk, replace=False)
            slots[c, b] = tables[c, b, idx // BLOCK] * BLOCK + idx % BLOCK
    kq, kc, ki = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (batch, heads, HEAD), jnp.bfloat16)
    blocks = copies * batch * per_seq + 1
    cache = jax.random.normal(kc, (blocks, BLOCK, 1, HEAD), jnp.bfloat16)
    index_cache = jax.random.normal(ki, (blocks, BLOCK, 1, INDEX_DIM), jnp.bfloat16)
    return q, (cache, index_cache), jnp.asarray(slots), jnp.asarray(tables)


def implementations(smoke: bool) -> tuple[dict, dict]:
    """{name: fn(q, (cache, index cache), slots, tables, kv_lens) -> [B, H, 512] (attention)
    or f32[B, context] (indexer scores)}, {name: why unavailable}."""
    impls, missing = {}, {}
    scale = HEAD**-0.5
    impls["sparse_xla"] = lambda q, c, s, t, n: sparse_mla_reference(
        q, c[0], s, sm_scale=scale, latent_dim=LATENT
    )
    try:
        from pallas_kernels.sparse_mla.mosaic import sparse_mla

        kernel = functools.partial(sparse_mla, sm_scale=scale, latent_dim=LATENT, interpret=smoke)
        impls["sparse_mosaic"] = lambda q, c, s, t, n: kernel(q, c[0], s)
    except ImportError as e:
        missing["sparse_mosaic"] = str(e)
    try:
        from pallas_kernels.paged_attention.kernel import ragged_paged_attention

        def dense(q, c, s, t, n):
            b = q.shape[0]
            qsl = jnp.arange(b + 1, dtype=jnp.int32)
            num = jnp.asarray([b], jnp.int32)
            return ragged_paged_attention(
                q, c[0], c[0], n, t, qsl, num, sm_scale=scale, decode_only=True,
                latent_dim=LATENT, interpret=smoke,
            )[..., :LATENT]  # fmt: skip

        impls["dense_triton"] = dense
    except ImportError as e:
        missing["dense_triton"] = str(e)

    def index_args(q, n):  # the indexer's queries and weights from q's first columns
        iq = q[:, :1, :INDEX_DIM].astype(jnp.float32) * jnp.ones((1, INDEX_HEADS, 1))
        return iq, jnp.ones((q.shape[0], INDEX_HEADS), jnp.float32) * 0.1, n - 1

    def indexer_xla(q, c, s, t, n):
        iq, iw, positions = index_args(q, n)
        return index_logits_reference(iq, iw, c[1], t, positions)

    impls["indexer_xla"] = indexer_xla
    try:
        from pallas_kernels.sparse_mla.indexer import index_logits

        def indexer(q, c, s, t, n):
            iq, iw, positions = index_args(q, n)
            return index_logits(iq, iw, c[1], t, positions, interpret=smoke)

        impls["indexer_mosaic"] = indexer
    except ImportError as e:
        missing["indexer_mosaic"] = str(e)
    return impls, missing


def seconds_per_call(fn, args, copies: int, n: int, iters: int) -> float:
    """(chain of n - chain of 1) / (n - 1): call i reads copy i mod copies, its query the
    previous output's latent with the rotary columns kept."""

    def chain(length):
        def run(q, cache, slots, tables, kv_lens):
            for i in range(length):
                out = fn(q, cache, slots[i % copies], tables[i % copies], kv_lens)
                if out.ndim == 2:  # indexer scores: q depends on them, unchanged
                    q = q + (jnp.max(out[:, :1]) * 0).astype(q.dtype)
                else:
                    q = jnp.concatenate([out.astype(q.dtype), q[..., LATENT:]], axis=-1)
            return q

        return jax.jit(run)

    t1 = median_seconds(chain(1), *args, warmup=1, iters=iters)
    tn = median_seconds(chain(n), *args, warmup=1, iters=iters)
    return max((tn - t1) / (n - 1), tn / n / 4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--chain", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rotate-mb", type=float, default=256.0)
    parser.add_argument("--copy-gbps", type=float, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, interpreted kernels")
    parser.add_argument("--max-seconds", type=float, default=1e9, help="start no case after")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.heads, args.batches, args.context, args.topk = "16", "1", 256, 128
        args.chain, args.iters, args.rotate_mb = 2, 1, 0.0
    copy_json = Path(os.environ.get("COPY_RATE_JSON") or "/nonexistent")
    if args.copy_gbps is None and copy_json.is_file():  # the suite's copy_rate step ran
        args.copy_gbps = json.loads(copy_json.read_text()).get("copy_gbps")
    device = jax.devices()[0]
    peak = peak_bandwidth(device)
    impls, missing = implementations(args.smoke)
    for name, why in missing.items():
        print(f"# {name}: unavailable ({why})")
    head = f"{'impl':<15}{'heads':>6}{'batch':>6}{'ctx':>7}{'us':>10}{'GB/s':>9}"
    print(f"{head}{'of copy':>9}{'of peak':>9}")
    rows, deadline = [], time.monotonic() + args.max_seconds
    first_heads = int(args.heads.split(",")[0])
    for heads in map(int, args.heads.split(",")):
        for batch in map(int, args.batches.split(",")):
            if time.monotonic() > deadline:
                print(f"# out of time: heads {heads} batch {batch} not measured")
                continue
            seq_bytes = args.context * (HEAD + INDEX_DIM) * 2
            copies = max(1, min(16, -(-int(args.rotate_mb * 2**20) // (batch * seq_bytes))))
            q, cache, slots, tables = make_case(batch, args.context, args.topk, heads, copies)
            kv_lens = jnp.full((batch,), args.context, jnp.int32)
            for name, fn in impls.items():
                if name.startswith("indexer") and heads != first_heads:
                    continue  # its heads are the indexer's own
                if name.startswith("indexer"):
                    read = batch * args.context * INDEX_DIM * 2
                elif name.startswith("dense"):
                    read = batch * args.context * HEAD * 2
                else:
                    read = batch * args.topk * HEAD * 2
                try:
                    s = seconds_per_call(
                        fn, (q, cache, slots, tables, kv_lens), copies, args.chain, args.iters
                    )
                except Exception as e:  # noqa: BLE001 - report the case, go on
                    print(f"# {name} failed on heads {heads} batch {batch}: {e}"[:400])
                    continue
                gbps = read / s / 1e9
                row = dict(impl=name, heads=heads, batch=batch, context=args.context,
                           topk=args.topk, us=s * 1e6, bytes=read, gbps=gbps,
                           of_copy=gbps / args.copy_gbps if args.copy_gbps else None,
                           of_peak=gbps / peak if peak else None)  # fmt: skip
                rows.append(row)

                def frac(x):
                    return f"{x:9.2f}" if x is not None else f"{'-':>9}"

                print(f"{name:<15}{heads:>6}{batch:>6}{args.context:>7}{s * 1e6:10.1f}"
                      f"{gbps:9.1f}{frac(row['of_copy'])}{frac(row['of_peak'])}")  # fmt: skip
    for heads in map(int, args.heads.split(",")):
        for batch in map(int, args.batches.split(",")):
            got = {r["impl"]: r for r in rows if (r["heads"], r["batch"]) == (heads, batch)}
            if "sparse_mosaic" in got and "dense_triton" in got:
                sp, de = got["sparse_mosaic"], got["dense_triton"]
                ratio, faster = sp["gbps"] / de["gbps"], de["us"] / sp["us"]
                print(
                    f"# sparse heads {heads} batch {batch}: mosaic {sp['gbps']:.0f} GB/s of the "
                    f"chosen rows, dense MLA {de['gbps']:.0f} GB/s of the context ({ratio:.2f}x); "
                    f"{faster:.1f}x faster"
                )
    for batch in map(int, args.batches.split(",")):
        got = {r["impl"]: r for r in rows if r["batch"] == batch}
        if "indexer_mosaic" in got and "indexer_xla" in got:
            mo, xl = got["indexer_mosaic"]["gbps"], got["indexer_xla"]["gbps"]
            print(f"# sparse indexer batch {batch}: mosaic {mo:.0f} GB/s, XLA {xl:.0f} GB/s")
    if args.output_json:
        meta = dict(device=device.device_kind, jax=jax.__version__, copy_gbps=args.copy_gbps)
        Path(args.output_json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
