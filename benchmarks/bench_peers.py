"""bench_latency against its peers, alternated: for each batch size, every backend runs once
per round (each run its own process: start-up, warm-up, timed iterations), for --rounds rounds;
the table gives each backend's median avg latency and decode step, and the first backend's
speed-up over each other one (their median latency / its). Alternating keeps a noisy shared
machine's drift out of the ratios.

    .venv/bin/python benchmarks/bench_peers.py --backends jaxserve,vllm,hf --batch-sizes 1,8,32 \\
        --rounds 3 --output-json benchmarks/results/peers.json -- --model /tmp/smollm2-hf \\
        --input-len 32 --output-len 64 --num-iters-warmup 1 --num-iters 3

Arguments after `--` go to scripts/bench_latency.py as they are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def run_once(backend: str, batch_size: int, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_latency.py"), "--backend", backend,
               "--batch-size", str(batch_size), "--output-json", out.name, *extra]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="jaxserve,vllm")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(own)
    backends = args.backends.split(",")
    runs: dict[str, dict[str, list[dict]]] = {}
    for batch in args.batch_sizes.split(","):
        runs[batch] = {b: [] for b in backends}
        for r in range(args.rounds):
            for backend in backends:
                result = run_once(backend, int(batch), extra)
                runs[batch][backend].append(result)
                print(f"batch {batch} round {r + 1} {backend}: {result['avg_latency']:.3f} s",
                      flush=True)  # fmt: skip
    table = []
    print(f"\n| batch | {' | '.join(backends)} | {backends[0]}'s speed-up (peer latency / its) |")
    print(f"|---|{'---|' * len(backends)}---|")
    for batch, per_backend in runs.items():
        med = {b: float(np.median([r["avg_latency"] for r in rs])) for b, rs in per_backend.items()}
        step = {
            b: float(np.median([r.get("decode_step_ms", np.nan) for r in rs]))
            for b, rs in per_backend.items()
        }
        cells = [f"{med[b]:.3f} s (step {step[b]:.1f} ms)" for b in backends]
        ratios = ", ".join(f"{med[b] / med[backends[0]]:.2f}x over {b}" for b in backends[1:])
        print(f"| {batch} | {' | '.join(cells)} | {ratios} |")
        table.append(
            {"batch_size": int(batch), "median_avg_latency_s": med, "median_step_ms": step}
        )
    results = {"table": table, "runs": runs, "bench_latency_args": extra, "rounds": args.rounds}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
