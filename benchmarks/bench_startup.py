"""Start-up time of `jaxserve serve`: launch to a 200 from /health, cold and warm.

Cold: the persistent XLA compilation cache ($JAXSERVE_COMPILE_CACHE, read by
worker/executables.py::enable_persistent_compilation_cache), the converted-weight cache
($JAXSERVE_WEIGHT_CACHE, models/weight_cache.py) and the model-config cache
($JAXSERVE_CONFIG_CACHE) point at fresh empty directories, so every step shape is compiled, a
GGUF dequantized and a config.json resolved by transformers. Warm: the same directories
again, now filled by the cold run (the step executables saved there load without tracing:
worker/executable_cache.py). Either way
the OS page cache may already hold the model file and Python's bytecode (this is a cold
compile, not a cold machine). Each run is stopped with SIGTERM once healthy, and once the
step shapes `serve` compiles or loads in the background after it is ready (--background-compile,
on by default) are all in and saved. The server's own log gives the compile share
("compiled|loaded N step shapes in X s") and the phase timeline ("start-up: ready in X s
(phase s; ...)"), printed under each run.

    .venv/bin/python benchmarks/bench_startup.py --num-warm 2 -- --max-model-len 1024
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from jaxserve.benchmarks.common import git_commit, write_json

COMPILED = re.compile(r"(compiled|loaded) (\d+) step shapes in ([\d.]+) s")
BACKGROUND = re.compile(r"\((\d+) more in the background\)")
ALL_READY = re.compile(r"more step shapes ready \(and saved\) in the background")
READY = re.compile(r"start-up: ready in ([\d.]+) s \((.*)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_startup(serve_args: list[str], cache_dir: str, timeout: float) -> dict:
    """Launch `jaxserve serve`, poll /health until 200; returns seconds and the compile line."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *serve_args]  # fmt: skip
    env = {**os.environ, "JAXSERVE_COMPILE_CACHE": os.path.join(cache_dir, "xla"),
           "JAXSERVE_WEIGHT_CACHE": os.path.join(cache_dir, "weights"),
           "JAXSERVE_CONFIG_CACHE": os.path.join(cache_dir, "configs")}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("the server exited during start-up:\n" + "".join(log[-30:]))
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"the server was not ready after {timeout:.0f} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        ready = time.perf_counter() - start
        all_ready = ready
        if any(map(BACKGROUND.search, log)):  # wait for the rest (saved: the next start's)
            while not any(map(ALL_READY.search, log)):
                if proc.poll() is not None or time.perf_counter() - start > timeout:
                    raise RuntimeError("the background compile did not finish")
                time.sleep(0.1)
            all_ready = time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(10)
    match = next((m for m in map(COMPILED.search, log) if m), None)
    timeline = next((m.group(2) for m in map(READY.search, log) if m), None)
    background = next((int(m.group(1)) for m in map(BACKGROUND.search, log) if m), 0)
    return dict(
        ready_s=ready,
        all_ready_s=all_ready,  # every step shape in (background_compile: after ready)
        num_background=background,
        executables=match.group(1) if match else None,  # "compiled" or "loaded" (saved)
        num_compiled=int(match.group(2)) if match else None,
        compile_s=float(match.group(3)) if match else None,
        timeline=timeline,  # the server's own "phase s; ..." line
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-warm", type=int, default=1, help="warm start-ups to time")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("serve_args", nargs="*", help="flags for jaxserve serve (after --)")
    args = parser.parse_args(argv)

    runs = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-caches-") as cache_dir:
        runs["cold"] = [time_startup(args.serve_args, cache_dir, args.timeout)]
        runs["warm"] = [
            time_startup(args.serve_args, cache_dir, args.timeout) for _ in range(args.num_warm)
        ]
    for kind, rs in runs.items():
        for r in rs:
            compiled = (
                f" ({r['executables']} {r['num_compiled']} step shapes in {r['compile_s']:.1f} s)"
                if r["compile_s"] is not None
                else ""
            )
            rest = (
                f"; the other {r['num_background']} in the background, all in after "
                f"{r['all_ready_s']:.1f} s"
                if r["num_background"]
                else ""
            )
            print(f"Start-up {kind}: {r['ready_s']:.1f} s to ready{compiled}{rest}")
            if r["timeline"]:
                print(f"  phases: {r['timeline']}")
    results = dict(commit=git_commit(), serve_args=args.serve_args, **runs)
    if args.output_json:
        write_json(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
