"""Issue 64, finding 2: one request's body or chat template holding up the others, on a running
`jaxserve serve` (the bundled default model), started by this script as
`.venv/bin/jaxserve serve --port 8124 --api-key K --trust-request-chat-template`
(with JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S=30, so a 5 s template renders to the end).

The box has 2 cores, shared with other work, so unloaded and loaded samples are taken in
pairs, one right after the other (the flood paused, then on), and each ratio is of the two
medians. Prints, and writes to request_body.json beside this script:
- a completion (a 32-token prompt, max_tokens 16, temperature 0): 5 pairs, unloaded and
  while another process sends 11.4 MB bodies of `{"messages": [{}, {}, ...]}` to /tokenize
  back to back: without the key (the middleware's 401), with it (the structure scan's 400),
  and, as a control for what the flood itself costs a 2-core box, to a sink process that
  reads each body at C speed and answers 401; each again with the flooding process at nice
  19 (standing in for a client on another machine); the API process's CPU time per flood
  request;
- the time the server takes to refuse one 11.4 MB and one 32 MiB body of `{}` with the key
  (client-side, loopback), beside the same bodies refused for want of the key (the transfer
  alone), and the scan alone in this process;
- a plain chat's latency alone, beside a trusted request template that renders for ~5 s
  (twice: the first starts the renderer pool's third child), and beside a process that only
  spins one core for 5 s (the render's CPU without the server).

    .venv/bin/python benchmarks/results/hardening-cpu-2026-12-04/request_body.py
"""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import server as serve_  # this folder's server.py

PORT, KEY = 8124, "K"
URL = f"http://127.0.0.1:{PORT}"
HERE = Path(__file__).resolve().parent
JAXSERVE = str(Path(sys.executable).parent / "jaxserve")
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
EMPTIES_11MB = b'{"messages": [' + b",".join([b"{}"] * 3_800_000) + b"]}"
EMPTIES_32MIB = b'{"messages": [' + b",".join([b"{}"] * ((32 * 2**20 - 20) // 3)) + b"]}"


def post(path: str, body, headers=AUTH, timeout: float = 300) -> tuple[float, httpx.Response]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.perf_counter()
    r = httpx.post(URL + path, content=content, headers=headers, timeout=timeout)
    return time.perf_counter() - start, r


def completion(ids: list[int]) -> float:
    body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    seconds, r = post("/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    return seconds


def flood(keyed: bool, port: int, niced: bool, go, stop, counts) -> None:
    """11.4 MB bodies to /tokenize back to back on one connection (a fresh one after the
    server closes it) while `go` is set, until `stop`; counts: [sent, 4xx, other]. niced:
    at the lowest CPU priority (nice 19), a stand-in for a client on another machine."""
    if niced:
        os.nice(19)
    headers = {"content-type": "application/json", "content-length": str(len(EMPTIES_11MB))}
    if keyed:
        headers["authorization"] = f"Bearer {KEY}"
    conn = None
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        try:
            conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/tokenize", EMPTIES_11MB, headers)
            r = conn.getresponse()
            r.read()
            counts[0] += 1
            counts[1 if r.status in (400, 401, 413) else 2] += 1
            if r.getheader("connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException):
            counts[0] += 1
            counts[2] += 1
            if conn is not None:
                conn.close()
            conn = None


def sink(port: int) -> None:
    """A stand-in server that reads each request's body whole at C speed and answers 401."""
    listener = socket.create_server(("127.0.0.1", port))
    buffer = bytearray(1 << 20)
    while True:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if b"\r\n\r\n" not in data:
                    break
                head, data = data.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                left = length - len(data)
                while left > 0:
                    left -= conn.recv_into(buffer, min(left, len(buffer)))
                data = b""
                conn.sendall(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")


def paired(ids: list[int], keyed: bool, port: int, niced: bool, server: psutil.Process) -> dict:
    go, stop, counts = mp.Event(), mp.Event(), mp.Array("i", 3)
    proc = mp.Process(target=flood, args=(keyed, port, niced, go, stop, counts))
    proc.start()
    unloaded, loaded, cpu, sent = [], [], 0.0, 0
    for _ in range(5):
        unloaded.append(completion(ids))
        go.set()
        time.sleep(1.5)  # the flood under way
        cpu_before, sent_before = sum(server.cpu_times()[:2]), counts[0]
        loaded.append(completion(ids))
        cpu += sum(server.cpu_times()[:2]) - cpu_before
        sent += counts[0] - sent_before
        go.clear()
        time.sleep(1.0)  # the last flood request answered
    stop.set()
    proc.join(120)
    return {
        "unloaded_s": [round(s, 3) for s in unloaded],
        "loaded_s": [round(s, 3) for s in loaded],
        "unloaded_median_s": round(statistics.median(unloaded), 3),
        "loaded_median_s": round(statistics.median(loaded), 3),
        "ratio": round(statistics.median(loaded) / statistics.median(unloaded), 2),
        "flood_requests": counts[0],
        "flood_4xx": counts[1],
        "flood_other": counts[2],
        "api_process_cpu_ms_per_flood_request": round(1e3 * cpu / max(sent, 1), 1),
        "load_average": [round(x, 1) for x in os.getloadavg()],
    }


def refusals() -> dict:
    out = {}
    for name, body in (("11.4MB", EMPTIES_11MB), ("32MiB", EMPTIES_32MIB)):
        for keyed in (True, False):
            headers = AUTH if keyed else {"content-type": "application/json"}
            times, answers = [], set()
            for _ in range(3):
                seconds, r = post("/tokenize", body, headers)
                times.append(seconds)
                answers.add(f"{r.status_code} {r.json()['error']['message']}")
            key = f"{name}_empties_{'with_key_scan' if keyed else 'without_key_401'}"
            out[key] = {"median_s": round(statistics.median(times), 3), "answers": sorted(answers)}
    return out


def scan_in_process() -> dict:
    from jaxserve.entrypoints.openai.json_limits import check_json_limits

    out = {}
    ids = json.dumps({"prompt": list(range(1_000_000))}).encode()
    for name, body in (("11.4MB_empties", EMPTIES_11MB), ("32MiB_empties", EMPTIES_32MIB),
                       ("1M_token_ids_prompt_passes", ids)):  # fmt: skip
        times = []
        for _ in range(5):
            start = time.perf_counter()
            with contextlib.suppress(ValueError):
                check_json_limits(body)
            times.append(time.perf_counter() - start)
        out[name + "_ms"] = round(1e3 * statistics.median(times), 1)
    return out


def slow_template(seconds: float) -> str:
    """A template that loops for about `seconds` (measured here, in this process)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def template(inner: int) -> str:
        return ("{% for i in range(100000) %}{% for j in range(" + str(inner) + ") %}"
                "{% endfor %}{% endfor %}{{ messages[0].content }}")  # fmt: skip

    times = []
    for _ in range(3):
        start = time.perf_counter()
        render_jinja_template(conversations=[[{"role": "user", "content": "x"}]],
                              chat_template=template(100))  # fmt: skip
        times.append(time.perf_counter() - start)
    return template(max(1, round(100 * seconds / min(times))))


PLAIN = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16,
         "temperature": 0, "ignore_eos": True}  # fmt: skip


def beside_slow_template(template: str) -> dict:
    result: dict = {}

    def slow() -> None:
        body = {**PLAIN, "max_tokens": 1, "chat_template": template}
        seconds, r = post("/v1/chat/completions", body)
        result["slow_template_request_s"] = round(seconds, 3)
        result["slow_template_status"] = r.status_code

    alone = post("/v1/chat/completions", PLAIN)[0]
    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)  # the slow one is rendering
    seconds, r = post("/v1/chat/completions", PLAIN)
    assert r.status_code == 200, r.text
    result["plain_chat_alone_just_before_s"] = round(alone, 3)
    result["plain_chat_beside_it_s"] = round(seconds, 3)
    result["slow_still_rendering_when_plain_answered"] = thread.is_alive()
    thread.join()
    return result


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def beside_a_spinner() -> dict:
    alone = post("/v1/chat/completions", PLAIN)[0]
    spinner = mp.Process(target=spin, args=(5.0,))
    spinner.start()
    time.sleep(0.5)
    beside = post("/v1/chat/completions", PLAIN)[0]
    spinner.join()
    return {"plain_chat_alone_just_before_s": round(alone, 3),
            "plain_chat_beside_it_s": round(beside, 3)}  # fmt: skip


LOG = os.path.join(tempfile.gettempdir(), "hardening-request-body-serve.log")


def main() -> None:
    env = {**os.environ, "JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S": "30"}
    env.pop("JAXSERVE_API_KEY", None)
    command = [JAXSERVE, "serve", "--port", str(PORT), "--api-key", KEY,
               "--trust-request-chat-template"]  # fmt: skip
    sink_proc = mp.Process(target=sink, args=(PORT + 1,), daemon=True)
    sink_proc.start()
    proc = serve_.start(command, LOG, URL, env)
    try:
        _, r = post("/tokenize", {"prompt": "The quick brown fox jumps over the lazy dog. " * 8})
        ids = r.json()["tokens"][:32]
        assert len(ids) == 32
        for _ in range(3):
            completion(ids)  # warm-up: compiles
        post("/v1/chat/completions", PLAIN)  # and the chat template's children: imported
        time.sleep(5)
        result = {
            "command": "JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S=30 " + " ".join(command),
            "machine": f"{platform.machine()} {os.cpu_count()}-core CPU box (shared with other "
            f"work), {platform.platform()}",
        }
        server = psutil.Process(proc.pid)
        for niced in (False, True):
            for name, keyed, port in (("without_key", False, PORT), ("with_key", True, PORT),
                                      ("control_to_a_sink_process", False, PORT + 1)):  # fmt: skip
                name = f"completion_beside_11MB_flood_{name}{'_niced' if niced else ''}"
                result[name] = paired(ids, keyed, port, niced, server)
                print(name, result[name], flush=True)
        result["refusal_client_side"] = refusals()
        result["scan_in_process"] = scan_in_process()
        result["trusted_5s_template_beside_plain_chat"] = [
            beside_slow_template(slow_template(5.0)) for _ in range(2)
        ]
        result["control_plain_chat_beside_a_process_spinning_one_core_5s"] = beside_a_spinner()
    finally:
        sink_proc.terminate()
        proc.terminate()
        proc.wait(60)
    print(json.dumps(result, indent=2))
    (HERE / "request_body.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
