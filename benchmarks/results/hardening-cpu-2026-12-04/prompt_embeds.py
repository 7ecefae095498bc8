"""Issue 64's must-show for prompt embeddings: a 15 KB bzip2 zip bomb (an entry that inflates
to 1 GiB) and a 10 KB stride-0 tensor of shape (200000, 576), each sent to a running
`jaxserve serve` (the bundled default model) without and with --enable-prompt-embeds: each
request's status, latency and the API process's peak-RSS growth (VmHWM after - before);
also a stride-0 tensor of max_model_len positions, which only the stride check refuses.

    .venv/bin/python benchmarks/results/hardening-cpu-2026-12-04/prompt_embeds.py \
        > benchmarks/results/hardening-cpu-2026-12-04/prompt_embeds.json

Starts each server itself on port 8123 and stops it (SIGTERM) afterwards.
"""

from __future__ import annotations

import base64
import io
import json
import os
import platform
import re
import signal
import subprocess
import time
import zipfile

import httpx
import server  # this folder's server.py
import torch

PORT = 8123
URL = f"http://127.0.0.1:{PORT}"
ROOT = os.path.dirname(os.path.abspath(__file__))
JAXSERVE = os.path.join(ROOT, "..", "..", "..", ".venv", "bin", "jaxserve")
REPEATS = 3


def bzip2_bomb() -> bytes:
    """torch.save's archive of a [1, 576] tensor, its data/0 entry replaced by 1 GiB of zeros
    compressed with bzip2 (about 15 KB of zip)."""
    with zipfile.ZipFile(io.BytesIO(saved(torch.zeros(1, 576)))) as z:
        files = {i.filename: z.read(i) for i in z.infolist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in files.items():
            if not name.endswith("/data/0"):
                z.writestr(name, data)
                continue
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_BZIP2
            with z.open(info, "w", force_zip64=True) as entry:
                chunk = bytes(1 << 24)
                for _ in range(64):  # 64 x 16 MiB = 1 GiB
                    entry.write(chunk)
    return out.getvalue()


def stride0() -> bytes:
    """A (200000, 576) float32 tensor (460 MB as an array) over a 10 KB storage, stride 0."""
    return saved(torch.zeros(2500).as_strided((200_000, 576), (0, 1)))


def stride0_within() -> bytes:
    """A (8192, 576) tensor (max_model_len positions) over a 10 KB storage, stride 0: the
    shape is allowed, so only the stride check refuses it."""
    return saved(torch.zeros(2500).as_strided((8192, 576), (0, 1)))


def saved(tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def vm(pid: int) -> dict[str, int]:
    """The process's VmHWM and VmRSS in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in f) if k in
                ("VmHWM", "VmRSS")}  # fmt: skip


def start(flags: list[str]) -> tuple[subprocess.Popen, int, str]:
    log_path = os.path.join("/tmp", f"prompt_embeds_serve_{len(flags)}.log")
    proc = server.start([JAXSERVE, "serve", "--port", str(PORT), *flags], log_path, URL)
    with open(log_path) as f:
        text = f.read()
    found = re.findall(r"Started server process \[(\d+)\]", text)
    return proc, int(found[-1]) if found else proc.pid, log_path


def measure(flags: list[str], payloads: dict[str, str]) -> dict:
    proc, pid, log_path = start(flags)
    results = {"flags": flags, "api_pid": pid, "requests": []}
    try:
        with httpx.Client(base_url=URL, timeout=120) as client:
            body = {"model": "default", "max_tokens": 1}
            models = client.get("/v1/models").json()["data"]
            body["model"] = models[0]["id"]
            # warm-up: the route's first request (lazy imports) is not the payloads' cost
            client.post("/v1/completions", json={**body, "prompt_embeds": "eA=="})
            results["rss_after_warmup_kib"] = vm(pid)
            for name, payload in payloads.items():
                for _ in range(REPEATS):
                    before = vm(pid)
                    t0 = time.perf_counter()
                    r = client.post("/v1/completions", json={**body, "prompt_embeds": payload})
                    latency = time.perf_counter() - t0
                    after = vm(pid)
                    results["requests"].append({
                        "payload": name, "status": r.status_code,
                        "latency_ms": round(latency * 1000, 1),
                        "vmhwm_growth_kib": after["VmHWM"] - before["VmHWM"],
                        "vmrss_after_kib": after["VmRSS"],
                        "message": r.json()["error"]["message"] if r.status_code >= 400 else None,
                    })  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        results["server_exit_code"] = proc.returncode
    return results


def main() -> None:
    t0 = time.perf_counter()
    raw = {"bzip2_bomb_1GiB": bzip2_bomb(), "stride0_200000x576": stride0(),
           "stride0_8192x576": stride0_within()}  # fmt: skip
    payloads = {name: base64.b64encode(data).decode() for name, data in raw.items()}
    report = {
        "command": ".venv/bin/python benchmarks/results/hardening-cpu-2026-12-04/prompt_embeds.py",
        "machine": f"{platform.machine()} {os.cpu_count()}-core CPU box, {platform.platform()}",
        "payload_bytes": {name: len(data) for name, data in raw.items()},
        "payload_build_s": round(time.perf_counter() - t0, 1),
        "limits": {"latency_ms": 100, "vmhwm_growth_kib": 10 * 1024},
        "runs": [measure([], payloads), measure(["--enable-prompt-embeds"], payloads)],
    }
    report["pass"] = all(
        r["status"] == 400 and r["latency_ms"] < 100 and r["vmhwm_growth_kib"] < 10 * 1024
        for run in report["runs"] for r in run["requests"]
    )  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
