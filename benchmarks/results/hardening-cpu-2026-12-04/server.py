"""What this folder's scripts share: start `jaxserve serve` and wait for its /health."""

from __future__ import annotations

import subprocess
import time

import httpx


def start(command: list[str], log_path: str, url: str, env: dict | None = None) -> subprocess.Popen:
    """`command` started with its output in log_path, once `url`/health answers 200;
    RuntimeError if it exits first or takes over 10 minutes."""
    with open(log_path, "w") as log:  # (the child keeps its own descriptor)
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within 600 s: see {log_path}")
