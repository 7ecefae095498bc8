"""Micro-benchmark of the frontend <-> EngineCore IPC path, in microseconds.

1. One step's outputs for N running requests (one new token each; optionally top-K logprobs):
   encode (MsgpackEncoder) + PUSH send + PULL receive + decode (MsgpackDecoder), over ipc://
   between two threads, as the core's output thread and the client's reader do it.
2. An empty-step round trip: the frontend sends an ABORT-sized request on its ROUTER, an echo
   thread (standing in for the core's input + output threads) answers with an empty
   EngineCoreOutputs on PUSH, and the frontend decodes it.

    python benchmarks/bench_ipc.py [--num-requests 256] [--iters 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import zmq

from jaxserve.ipc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    SchedulerStats,
)
from jaxserve.ipc.serialization import MsgpackDecoder, MsgpackEncoder


def step_outputs(n: int, logprobs: int) -> EngineCoreOutputs:
    outs = []
    for i in range(n):
        lp = None
        if logprobs:
            lp = [([-0.5] * (logprobs + 1), list(range(logprobs + 1)), 1)]  # one new token
        outs.append(EngineCoreOutput(f"req-{i}", [1000 + i], logprobs=lp, num_cached_tokens=16))
    stats = SchedulerStats(num_running_reqs=n, kv_cache_usage=0.5)
    return EngineCoreOutputs(outs, stats, timestamp=time.time())


def bench_outputs(ctx, run_dir: str, n: int, logprobs: int, iters: int) -> dict:
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{run_dir}/out{logprobs}")
    message = step_outputs(n, logprobs)
    ready = threading.Event()

    def producer():
        encoder = MsgpackEncoder()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"ipc://{run_dir}/out{logprobs}")
        ready.set()
        for _ in range(iters):
            frames = encoder.encode(message)
            push.send(frames[0], copy=True)
        push.close()

    decoder = MsgpackDecoder(EngineCoreOutputs)
    thread = threading.Thread(target=producer)
    thread.start()
    ready.wait()
    start = time.perf_counter()
    size = 0
    for _ in range(iters):
        frames = pull.recv_multipart(copy=False)
        size = len(frames[0].buffer)
        decoded = decoder.decode(frames)
    elapsed = time.perf_counter() - start
    thread.join()
    pull.close()
    assert len(decoded.outputs) == n
    # Pipelined throughput: the time per message with encode and decode on two threads.
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    t_enc = timeit(lambda: bytes(enc.encode(message)[0]), iters)
    blob = bytes(enc.encode(message)[0])
    t_dec = timeit(lambda: dec.decode(blob), iters)
    return {
        "bytes": size,
        "pipelined_us": elapsed / iters * 1e6,
        "encode_us": t_enc,
        "decode_us": t_dec,
    }


def bench_round_trip(ctx, run_dir: str, iters: int) -> list[float]:
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{run_dir}/in")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{run_dir}/rt")
    stop = threading.Event()

    def echo():
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"core")
        dealer.connect(f"ipc://{run_dir}/in")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"ipc://{run_dir}/rt")
        dealer.send(b"")
        decoder, encoder = MsgpackDecoder(list[str]), MsgpackEncoder()
        empty = EngineCoreOutputs()
        while not stop.is_set():
            if not dealer.poll(100):
                continue
            frames = dealer.recv_multipart(copy=False)
            decoder.decode(frames[1:])
            push.send(encoder.encode(empty)[0], copy=True)
        dealer.close()
        push.close()

    thread = threading.Thread(target=echo)
    thread.start()
    identity, _ = router.recv_multipart()
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        frames = encoder.encode(["req-0"])
        router.send_multipart([identity, EngineCoreRequestType.ABORT.value, bytes(frames[0])])
        decoder.decode(pull.recv_multipart(copy=False))
        times.append((time.perf_counter() - start) * 1e6)
    stop.set()
    thread.join()
    router.close()
    pull.close()
    return times


def timeit(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args(argv)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="jaxserve-bench-") as run_dir:
        for logprobs in (0, 5):
            r = bench_outputs(ctx, run_dir, args.num_requests, logprobs, args.iters)
            print(
                f"step outputs, {args.num_requests} requests, logprobs={logprobs}: "
                f"{r['bytes']} B; encode {r['encode_us']:.1f} us, decode {r['decode_us']:.1f} us, "
                f"encode+send+recv+decode pipelined {r['pipelined_us']:.1f} us/step"
            )
        times = bench_round_trip(ctx, run_dir, args.iters)
        print(
            f"empty-step round trip (ROUTER -> DEALER -> PUSH -> PULL): median "
            f"{statistics.median(times):.1f} us, p99 {sorted(times)[int(0.99 * len(times))]:.1f} us"
        )
    ctx.term()


if __name__ == "__main__":
    main()
