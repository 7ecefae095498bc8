"""KV transfer throughput: the ZmqConnector's producer -> consumer fetch (host to host over
TCP on this machine) and the device <-> host block copies every connector's load and save run
(worker/kv_block_io.py), in GB/s of KV moved.

    python benchmarks/bench_kv_transfer.py [--layout smollm2|llama-3-8b] [--output-json F]

Layouts: smollm2 = the default model's blocks (30 layers, 3 KV heads of 64, fp32 on CPU:
0.70 MiB a block); llama-3-8b = 32 layers, 8 KV heads of 128, bf16 (2 MiB a block)."""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import KVTransferConfig
from jaxserve.distributed.kv_transfer.base import BlockLayout
from jaxserve.distributed.kv_transfer.zmq_connector import ZmqConnector
from jaxserve.worker import kv_block_io

LAYOUTS = {
    "smollm2": ((30, 16, 3, 2 * 64), np.float32),
    "llama-3-8b": ((32, 16, 8, 2 * 128), jnp.bfloat16),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_zmq(layout: BlockLayout, counts: list[int], repeats: int) -> list[dict]:
    port = free_port()
    base = {"kv_connector": "ZmqConnector", "kv_port": port}
    producer = ZmqConnector(KVTransferConfig(**base, kv_role="kv_producer"), layout)
    consumer = ZmqConnector(KVTransferConfig(**base, kv_role="kv_consumer"), layout)
    rng = np.random.default_rng(0)
    rows = []
    try:
        top = max(counts)
        hashes = [rng.bytes(32) for _ in range(top)]
        blocks = rng.standard_normal((top, *layout.shape), np.float32).astype(layout.dtype)
        producer.write(hashes, blocks)
        address = f"tcp://127.0.0.1:{port}"
        for n in counts:

            def fetch(n=n):
                consumer._fetching["bench"] = list(range(n))
                consumer._fetch("bench", address, hashes[:n])
                got = consumer.get_finished_recving()["bench"]
                assert got == n * layout.block_size, got

            seconds = timed(fetch, repeats)
            rows.append(_row("zmq fetch (producer host -> consumer host)", n, layout, seconds))
    finally:
        producer.shutdown()
        consumer.shutdown()
    return rows


def bench_device_copies(layout: BlockLayout, counts: list[int], repeats: int) -> list[dict]:
    layers, bs, heads, width = layout.shape
    num_blocks = max(512, 2 * max(counts))
    shape = (layers * num_blocks, bs, heads, width // 2)
    kv = (jnp.zeros(shape, layout.dtype), jnp.ones(shape, layout.dtype))
    gather = jax.jit(lambda kv, ids: kv_block_io.gather_blocks(kv, ids, num_slots=layers))
    scatter = jax.jit(
        lambda kv, ids, b: kv_block_io.scatter_blocks(kv, ids, b, num_slots=layers),
        donate_argnums=(0,),
    )
    rows = []
    for n in counts:
        ids = jnp.arange(1, n + 1, dtype=jnp.int32)[:, None]  # [n, G]: one KV-cache group
        seconds = timed(lambda ids=ids: np.asarray(gather(kv, ids)), repeats)
        rows.append(_row("save: device -> host (gather + copy)", n, layout, seconds))
        host = np.asarray(gather(kv, ids))

        def load(ids=ids, host=host):
            nonlocal kv
            kv = scatter(kv, ids, jnp.asarray(host))
            jax.block_until_ready(kv)

        seconds = timed(load, repeats)
        rows.append(_row("load: host -> device (copy + scatter)", n, layout, seconds))
    return rows


def _row(what: str, n: int, layout: BlockLayout, seconds: float) -> dict:
    nbytes = n * layout.nbytes
    return {"path": what, "blocks": n, "MiB": round(nbytes / 2**20, 2),
            "ms": round(seconds * 1e3, 3), "GB/s": round(nbytes / seconds / 1e9, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=list(LAYOUTS), default="smollm2")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    shape, dtype = LAYOUTS[args.layout]
    layout = BlockLayout(shape, np.dtype(dtype), "bench")
    rows = bench_zmq(layout, args.blocks, args.repeats)
    rows += bench_device_copies(layout, args.blocks, args.repeats)
    device = jax.devices()[0]
    print(f"# {args.layout} blocks of {layout.nbytes / 2**20:.2f} MiB; {device.device_kind} "
          f"({jax.default_backend()}), jax {jax.__version__}, {platform.machine()}")  # fmt: skip
    print("| path | blocks | MiB | ms | GB/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['blocks']} | {r['MiB']} | {r['ms']} | {r['GB/s']} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"layout": args.layout, "device": device.device_kind,
                       "backend": jax.default_backend(), "jax": jax.__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
