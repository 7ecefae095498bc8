"""Issue 64, finding 6: the Responses store holds what it counts. A running `jaxserve serve`
(the default model) with the store on and a 32 MiB cap,

    JAXSERVE_ENABLE_RESPONSES_API_STORE=1 JAXSERVE_RESPONSES_STORE_MAX_BYTES=33554432 \
        .venv/bin/jaxserve serve --port 8126

is sent N stored responses (max_output_tokens 1) of 2.9 MB each, as many `{}` objects as the
server accepts in a field the store keeps: an extra key of an input item (the bounded settings,
`metadata`, `reasoning`, `text.format`, `tool_choice`, refuse them; the body scan,
json_limits.py, refuses more than 65,536 arrays and objects in a body, so a 2.9 MB body of
`{}` alone, sent first, is a 400), the rest of the 2.9 MB a string in another extra key. The
API process's RSS (VmRSS, /proc) is read before the first and after every 5th, with its peak
(VmHWM) at the end; the growth must stay within the cap plus 20%. For scale: what one such
body takes as the Python objects the store held before (tracemalloc, in this process).

    .venv/bin/python benchmarks/results/hardening-cpu-2026-12-04/responses_store.py

Prints, and writes to responses_store.json beside this script.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import httpx
import msgspec
import server  # this folder's server.py

PORT, CAP, N = 8126, 32 * 2**20, 40
URL = f"http://127.0.0.1:{PORT}"
HERE = Path(__file__).resolve().parent
JAXSERVE = str(Path(sys.executable).parent / "jaxserve")
ALL_EMPTY = 966_000  # `{}` objects: 2.9 MB of JSON
EMPTY = 65_000  # under json_limits.MAX_CONTAINERS
PAD = 2_700_000  # characters: 2.9 MB with the `{}`


def body(i: int, empty: int = EMPTY, pad: int = PAD) -> bytes:
    item = {"role": "user", "content": f"Say {i}.", "x": [{}] * empty, "pad": "a" * pad}
    return json.dumps({"input": [item], "max_output_tokens": 1}, separators=(",", ":")).encode()


def rss(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of the process, in bytes."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def as_objects(data: bytes) -> int:
    """Bytes the decoded body takes as Python objects (what the store used to hold)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held = msgspec.json.decode(data)
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del held
    return size


def run(cap: int, n: int, extra_env: dict[str, str]) -> dict:
    """One server, `n` stored 2.9 MB responses with the store capped at `cap` bytes."""
    env = {**os.environ, "JAXSERVE_ENABLE_RESPONSES_API_STORE": "1",
           "JAXSERVE_RESPONSES_STORE_MAX_BYTES": str(cap), **extra_env}  # fmt: skip
    command = [JAXSERVE, "serve", "--port", str(PORT)]
    proc = server.start(command, str(HERE / "responses_store-server.log"), URL, env)
    try:
        client = httpx.Client(timeout=300, headers={"content-type": "application/json"})
        warm = client.post(URL + "/v1/responses", json={"input": "hi", "max_output_tokens": 1})
        assert warm.status_code == 200, warm.text
        refused = client.post(URL + "/v1/responses", content=body(0, ALL_EMPTY, 0))
        refused = {"body_bytes": len(body(0, ALL_EMPTY, 0)), "status": refused.status_code,
                   "message": refused.json()["error"]["message"]}  # fmt: skip
        start = rss(proc.pid)
        rows, ids, started = [], [], time.monotonic()
        for i in range(1, n + 1):
            r = client.post(URL + "/v1/responses", content=body(i))
            assert r.status_code == 200 and r.json()["store"] is True, r.text[:500]
            ids.append(r.json()["id"])
            if i % 5 == 0:
                now = rss(proc.pid)
                grew = (now["VmRSS"] - start["VmRSS"]) / 2**20
                rows.append({"requests": i, "rss_mib": round(now["VmRSS"] / 2**20, 1),
                             "growth_mib": round(grew, 1)})  # fmt: skip
        seconds = time.monotonic() - started
        end = rss(proc.pid)
        kept = [client.get(f"{URL}/v1/responses/{rid}").status_code for rid in ids]
    finally:
        proc.terminate()
        proc.wait(60)
    growth = end["VmRSS"] - start["VmRSS"]
    settings = " ".join(f"{k}={v}" for k, v in extra_env.items())
    result = {
        "command": f"{settings} JAXSERVE_ENABLE_RESPONSES_API_STORE=1 "
        f"JAXSERVE_RESPONSES_STORE_MAX_BYTES={cap} {' '.join(command)}".strip(),
        "all_empty_objects_body": refused,
        "requests": n,
        "seconds": round(seconds, 1),
        "store_cap_mib": cap / 2**20,
        "rss_before_mib": round(start["VmRSS"] / 2**20, 1),
        "rss_after_mib": round(end["VmRSS"] / 2**20, 1),
        "rss_growth_mib": round(growth / 2**20, 1),
        "peak_rss_mib": round(end["VmHWM"] / 2**20, 1),
        "bound_mib": cap * 1.2 / 2**20,
        "within_bound": growth <= cap * 1.2,
        "every_5": rows,
        "still_stored": kept.count(200),
        "evicted_404": kept.count(404),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "every_5"}))
    return result


def main() -> None:
    # `jaxserve serve` keeps glibc's mmap threshold fixed (server_setup.return_freed_memory),
    # so freed large blocks go back to the system at once; before it did, the 32 MiB run grew
    # 43.6 MiB (responses_store-before-return-freed-memory.json).
    runs = [run(32 * 2**20, 40, {}), run(256 * 2**20, 130, {})]  # a small cap, the default
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()}-core CPU box, {platform.platform()}",
        "script": ".venv/bin/python benchmarks/results/hardening-cpu-2026-12-04/responses_store.py",
        "body_bytes": len(body(1)),
        "body": f"one input item with an extra key holding {EMPTY} `{{}}` objects and another "
        f"a string of {PAD} characters; max_output_tokens 1",
        "one_body_as_python_objects_mib": round(as_objects(body(1)) / 2**20, 1),
        "all_empty_body_as_python_objects_mib": round(as_objects(body(0, ALL_EMPTY, 0)) / 2**20, 1),
        "runs": runs,
    }
    (HERE / "responses_store.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
