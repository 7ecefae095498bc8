"""Issue 64, finding 3: who may call what on a running `jaxserve serve` (the default model),
started as `JAXSERVE_SERVER_DEV_MODE=1 .venv/bin/jaxserve serve --port 8125 --api-key K`.

Prints, and writes to auth.json beside this script, the HTTP status of: every guarded route
without the key (401 expected) and the probes without it (not 401); the lower-case and
upper-case Bearer scheme; bodyless POSTs with the key but without the JSON Content-Type (400);
/collective_rpc "initialize_kv_cache" (400) with the engine serving after it; a timeout of -1
(400 JSON); and a dev-mode start without a key (refused before loading).

    .venv/bin/python benchmarks/results/hardening-cpu-2026-12-04/auth.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import server  # this folder's server.py

PORT, KEY = 8125, "K"
URL = f"http://127.0.0.1:{PORT}"
HERE = Path(__file__).resolve().parent
JAXSERVE = str(Path(sys.executable).parent / "jaxserve")
DEV = ["/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache",
       "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
       "/finish_weight_update", "/collective_rpc"]  # fmt: skip
GUARDED = [*(("POST", p) for p in DEV), ("GET", "/is_sleeping"), ("GET", "/is_paused"),
           ("GET", "/get_world_size"), ("POST", "/v2/rerank"), ("POST", "/rerank"),
           ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/score"),
           ("POST", "/classify"), ("POST", "/pooling"), ("GET", "/v1/models"),
           ("POST", "/v1/completions"), ("GET", "/no-such-route")]  # fmt: skip
PROBES = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/ready"),
          ("GET", "/metrics"), ("GET", "/version")]  # fmt: skip
JSON = {"content-type": "application/json"}


def status(method: str, path: str, headers: dict, body: dict | None = None) -> int:
    content = json.dumps(body).encode() if body is not None else None
    return httpx.request(
        method, URL + path, headers=headers, content=content, timeout=120
    ).status_code


LOG = os.path.join(tempfile.gettempdir(), "hardening-auth-serve.log")


def main() -> None:
    env = {**os.environ, "JAXSERVE_SERVER_DEV_MODE": "1"}
    env.pop("JAXSERVE_API_KEY", None)
    no_key = subprocess.run([JAXSERVE, "serve", "--port", str(PORT)], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    last_line = (no_key.stderr or no_key.stdout).strip().splitlines()[-1]
    refused_start = {"exit_code": no_key.returncode, "last_line": last_line}
    print("dev mode without a key:", refused_start)

    command = [JAXSERVE, "serve", "--port", str(PORT), "--api-key", KEY]
    started = time.monotonic()
    proc = server.start(command, LOG, URL, env)
    try:
        print(f"server ready in {time.monotonic() - started:.0f} s")
        auth = {"authorization": f"Bearer {KEY}"}
        result = {
            "command": f"JAXSERVE_SERVER_DEV_MODE=1 {' '.join(command)}",
            "machine": f"{platform.machine()} {os.cpu_count()}-core CPU box, {platform.platform()}",
            "dev_mode_without_a_key": refused_start,
            "without_the_key": {f"{m} {p}": status(m, p, JSON, {}) for m, p in GUARDED},
            "probes_without_the_key": {f"{m} {p}": status(m, p, {}) for m, p in PROBES},
            "scheme_case": {
                h: status("GET", "/v1/models", {"authorization": f"{h} {KEY}"})
                for h in ("bearer", "BEARER", "Bearer")
            },
            "tokenize_lower_case_bearer": status(
                "POST", "/tokenize", {"authorization": f"bearer {KEY}", **JSON}, {"prompt": "hi"}
            ),
            "bodyless_post_with_the_key_without_content_type": {
                p: status("POST", p, auth) for p in ("/sleep", "/reset_prefix_cache", "/pause")
            },
            "bodyless_post_with_the_key_as_text_plain": {
                p: status("POST", p, {**auth, "content-type": "text/plain"})
                for p in ("/sleep", "/reset_prefix_cache", "/pause")
            },
        }
        keyed = {**auth, **JSON}
        kill = httpx.post(URL + "/collective_rpc", headers=keyed, timeout=60,
                          json={"method": "initialize_kv_cache", "args": [1]})  # fmt: skip
        minus = httpx.post(URL + "/collective_rpc", headers=keyed, timeout=60,
                           json={"method": "max_step_tokens", "timeout": -1})  # fmt: skip
        ok = httpx.post(URL + "/collective_rpc", headers=keyed, timeout=60,
                        json={"method": "max_step_tokens"})  # fmt: skip
        completion = httpx.post(URL + "/v1/completions", headers=keyed, timeout=300,
                                json={"prompt": "Hello", "max_tokens": 4})  # fmt: skip
        result["collective_rpc"] = {
            "initialize_kv_cache": [kill.status_code, kill.json()],
            "timeout_-1": [minus.status_code, minus.headers["content-type"], minus.json()],
            "max_step_tokens": [ok.status_code, ok.json()],
            "then_a_completion": completion.status_code,
            "then_health": status("GET", "/health", {}),
        }
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps(result, indent=1))
    (HERE / "auth.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
