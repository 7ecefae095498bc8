"""`jaxserve serve --api-server-count N`: N HTTP server processes over the same engines (vLLM's
scale-out frontend).

The launcher (the `jaxserve serve` process) binds the listening socket, starts the engines
(`engine/launch.py::EngineGroup`, with its data_parallel_size engines and coordinator) with one
frontend address pair per API server, then starts N API-server processes
(`python -m jaxserve.entrypoints.openai.multi_server RUN_DIR INDEX FD`). Each inherits the
listening socket (the kernel hands each new connection to one of them), joins the engines as
client INDEX (AsyncMPClient(group=...)) and serves the same app as a single server. Metrics go
through prometheus-client's multiprocess files, so /metrics on any server reports them all.

The launcher then watches: an engine that dies is reported to every API server at once (it
sends ENGINE_CORE_DEAD on each one's output socket; they fail their requests and exit 1), an
API server that exits takes the others and the engines down, and SIGTERM / SIGINT is passed to
the API servers (each drains its requests) before the engines are stopped. It exits 1 when
anything died, 0 after a clean shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from jaxserve.engine.launch import EngineGroup, client_addresses, shutdown_procs
from jaxserve.entrypoints.openai.api_server import bind_socket, check_server_args, serve_http
from jaxserve.ipc.messages import ENGINE_CORE_DEAD

logger = logging.getLogger("jaxserve.api_server")

WATCH_S = 0.2
LOG_PREFIX = "(APIServer{} pid=%(process)d) "  # every log line of API server i, uvicorn's too


def run_multi_api_server(args, engine_args) -> int:
    """`jaxserve serve --api-server-count N`, N > 1: bind the port and check the flags (as
    api_server.run_server does), then run_api_servers; returns the exit status."""
    sock = bind_socket(args.host, args.port)
    check_server_args(args)
    return run_api_servers(args, engine_args, sock)


def run_api_servers(args, engine_args, sock: socket.socket) -> int:
    """Start the engines and args.api_server_count API servers on `sock`; returns the exit
    status once they have all stopped."""
    count = args.api_server_count
    run_dir = tempfile.mkdtemp(prefix="jaxserve-")
    metrics_dir = os.path.join(run_dir, "prometheus")
    os.mkdir(metrics_dir)
    clients = client_addresses(run_dir, count)
    group = EngineGroup(engine_args, clients, run_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
    with open(os.path.join(run_dir, "api_server.pkl"), "wb") as f:
        pickle.dump((plain, group.info, group.timeline.phases), f)
    sock.set_inheritable(True)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", __name__, run_dir, str(i), str(sock.fileno())],
            pass_fds=(sock.fileno(),),
            env=env,
        )
        for i in range(count)
    ]
    sock.close()  # the API servers hold it
    logger.info("started %d API servers (pids %s)", count, [s.pid for s in servers])
    status = 0
    try:
        while not stop.wait(WATCH_S):
            if (reason := group.poll()) is not None:
                logger.error("engine core died (%s): stopping the API servers", reason)
                _report_dead(clients)
                status = 1
                break
            if any((code := s.poll()) is not None for s in servers):
                logger.error("an API server exited (code %s): stopping the others", code)
                status = 1
                break
        # SIGTERM: each API server drains its requests (--shutdown-timeout), then exits.
        shutdown_procs(servers, timeout=args.shutdown_timeout + 10)
        if any(s.returncode not in (0, -signal.SIGTERM) for s in servers):
            status = 1
    finally:
        group.shutdown()
    return status


def _report_dead(clients: list[dict[str, str]]) -> None:
    """Tell every API server at once that an engine is gone (as a dying core would)."""
    ctx = zmq.Context()
    for client in clients:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(client["output"])
        push.send(ENGINE_CORE_DEAD)
        push.close()
    ctx.term()


def run_api_server(run_dir: str, index: int, fd: int) -> None:
    """One API-server process: join the engines as client `index` and serve on the shared
    socket."""
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.core_client import AsyncMPClient
    from jaxserve.startup import StartupTimeline
    from jaxserve.tracing import init_tracer
    from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME
    from jaxserve.transformers_utils.tokenizer import read_tokenizer

    started = time.perf_counter()
    with open(os.path.join(run_dir, "api_server.pkl"), "rb") as f:
        args, info, core_phases = pickle.load(f)
    client = AsyncMPClient(group=info, client_index=index)
    client.timeline = StartupTimeline()
    client.timeline.extend("", core_phases)
    config = info.config
    tracer = init_tracer(args.otlp_traces_endpoint, args.model or DEFAULT_MODEL_NAME)
    engine = AsyncLLM(
        config,
        client,
        tokenizer=read_tokenizer(config.tokenizer_path or config.model_path, config.tokenizer_mode),
        tracer=tracer,
    )
    client.timeline.add(f"API server {index} set-up", time.perf_counter() - started)
    serve_http(args, engine, socket.socket(fileno=fd), started, log_prefix=LOG_PREFIX.format(index))


if __name__ == "__main__":
    index = int(sys.argv[2])
    logging.basicConfig(
        level=logging.INFO, format=LOG_PREFIX.format(index) + "%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("absl").setLevel(logging.WARNING)
    run_api_server(sys.argv[1], index, int(sys.argv[3]))
