"""Issue 64's must-show for image inputs, through `fetch_images` (what /v1/chat/completions
awaits for a request's images), each case in a fresh process: its time and its peak-RSS
growth (VmHWM after the call minus VmRSS before it, the peak reset just before):

- png9000: the 236 KB 9000x9000 PNG as a data URL (refused by its header's size);
- png9000_x3: three of them in one request;
- jpeg24mp: a 24-megapixel (6000x4000) JPEG as a data URL (served, decoded at 1/2);
- *_before: the same through the media.py of commit c3cdc24 (the audited one), for scale;
- loopback: http://127.0.0.1:PORT/x.png with the default rules, a listening socket that
  no one accepts on counting the connections made to it (its backlog);
- fanout: 40 image URLs to a slow local server (private addresses allowed), the most
  requests it saw at once.

    .venv/bin/python benchmarks/results/hardening-cpu-2026-12-04/media.py \
        > benchmarks/results/hardening-cpu-2026-12-04/media.json
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import importlib.util
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, ROOT)
BEFORE = "c3cdc24"
LIMITS = {"max_bytes": 20 << 20, "timeout": 5.0, "allowed_local_media_path": None}


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def media_module(before: bool):
    """jaxserve.multimodal.media, or the one of commit BEFORE (from git) when `before`."""
    if not before:
        from jaxserve.multimodal import media

        return media
    source = subprocess.run(["git", "-C", ROOT, "show", f"{BEFORE}:jaxserve/multimodal/media.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    spec = importlib.util.spec_from_loader("media_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{BEFORE}:media.py", "exec"), module.__dict__)
    return module


def child(case: str, payloads: str) -> dict:
    """One case, in this (fresh) process."""
    before = case.endswith("_before")
    media = media_module(before)
    name = case.removesuffix("_before")
    urls, extra = [], {}
    if name.startswith("png9000"):
        with open(os.path.join(payloads, "png9000.png"), "rb") as f:
            data = f.read()
        urls = [f"data:image/png;base64,{base64.b64encode(data).decode()}"] * (
            3 if name.endswith("x3") else 1
        )
        extra["payload_bytes"] = len(data)
    elif name == "jpeg24mp":
        with open(os.path.join(payloads, "jpeg24mp.jpg"), "rb") as f:
            data = f.read()
        urls = [f"data:image/jpeg;base64,{base64.b64encode(data).decode()}"]
        extra["payload_bytes"] = len(data)
    elif name == "loopback":
        os.environ.pop("JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS", None)
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        urls = [f"http://127.0.0.1:{listener.getsockname()[1]}/x.png"]
    elif name == "fanout":
        os.environ["JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS"] = "1"
        server = SlowServer(0.2)
        urls = [f"{server.url}/x.png?{i}" for i in range(40)]
    gc.collect()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    rss0 = status("VmRSS")
    start = time.perf_counter()
    try:
        images = asyncio.run(media.fetch_images(urls, **LIMITS))
        sizes = sorted({f"{i.size[0]}x{i.size[1]}" for i in images})
        outcome = {"served_images": len(images), "decoded_sizes": sizes}
    except ValueError as e:
        outcome = {"refused": str(e)[:300]}
    seconds = time.perf_counter() - start
    peak = status("VmHWM")
    images = None
    gc.collect()
    result = {
        "case": case,
        "code": f"commit {BEFORE}" if before else "this tree",
        **extra,
        **outcome,
        "seconds": round(seconds, 3),
        "peak_rss_growth_mb": round((peak - rss0) / 2**20, 1),
        "rss_after_minus_before_mb": round((status("VmRSS") - rss0) / 2**20, 1),
    }
    if name == "loopback":
        accepted = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                listener.accept()[0].close()
                accepted += 1
        result["listener_connections"] = accepted
    if name == "fanout":
        result["urls"] = len(urls)
        result["most_requests_at_once"] = server.most_at_once
    return result


class SlowServer:
    """A local HTTP server answering every GET with a 1x1 PNG after `delay` s, counting the
    most requests it serves at once."""

    def __init__(self, delay: float):
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (1, 1)).save(buf, format="PNG")
        png, server, lock = buf.getvalue(), self, threading.Lock()
        self.now = self.most_at_once = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                with lock:
                    server.now += 1
                    server.most_at_once = max(server.most_at_once, server.now)
                time.sleep(delay)
                with lock:
                    server.now -= 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        threading.Thread(target=httpd.serve_forever, daemon=True).start()


def make_payloads(directory: str) -> None:
    from PIL import Image

    from tests.multimodal.test_media import blank_png

    with open(os.path.join(directory, "png9000.png"), "wb") as f:
        f.write(blank_png(9000, 9000))
    buf = io.BytesIO()
    # a photo-like gradient: noise-free, so the JPEG stays small, but not one flat colour
    Image.linear_gradient("L").resize((6000, 4000)).convert("RGB").save(buf, "JPEG", quality=85)
    with open(os.path.join(directory, "jpeg24mp.jpg"), "wb") as f:
        f.write(buf.getvalue())


CASES = ["png9000", "png9000_x3", "jpeg24mp", "png9000_before", "jpeg24mp_before", "loopback",
         "fanout"]  # fmt: skip


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    results = []
    with tempfile.TemporaryDirectory() as payloads:
        make_payloads(payloads)
        for case in CASES:
            out = subprocess.run([sys.executable, __file__, "--child", case, payloads],
                                 capture_output=True, text=True, cwd=ROOT)  # fmt: skip
            if out.returncode:
                raise SystemExit(f"{case} failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({
        "command": "benchmarks/results/hardening-cpu-2026-12-04/media.py",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
                   "(a shared 2-core CPU box), Linux",
        "python": platform.python_version(),
        "results": results,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
