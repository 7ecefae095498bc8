"""Starting the engine cores: data_parallel_size EngineCore processes and, with more than one,
the DP coordinator (vLLM V1's CoreEngineProcManager and launch_core_engines).

The frontends (one per API server; `client_addresses`) each bind an input ROUTER and an output
PULL socket; every engine connects a DEALER and a PUSH to every frontend, so any frontend can
send a request to any engine and each engine sends a request's outputs to the frontend it came
from. The group's owner (the frontend's client with one API server; the `jaxserve serve`
launcher with several) holds a handshake ROUTER:

    engine -> HELLO {engine_index, pid}
    group  -> {engine_index, inputs, outputs, coordinator}   the addresses to connect to
    engine -> READY {num_blocks, config, timeline}           loaded, compiled, KV allocated
              (or FAILED {error}: the start-up error, raised here)

Each engine process gets its own devices: with data parallelism, `CUDA_VISIBLE_DEVICES` lists
its tensor_parallel_size GPUs (engine i: the i-th group of them); on CPU each process has its
own XLA host devices anyway.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import time
from typing import Any

import msgspec
import zmq

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.coordinator import coordinator_addresses
from jaxserve.startup import StartupTimeline

HANDSHAKE_POLL_S = 1.0


def client_addresses(run_dir: str, num_clients: int) -> list[dict[str, str]]:
    """Per frontend (client index): the input and output addresses it binds."""
    return [
        {"input": f"ipc://{run_dir}/input_{i}", "output": f"ipc://{run_dir}/output_{i}"}
        for i in range(num_clients)
    ]


def engine_identity(engine_index: int) -> bytes:
    """An engine's ZeroMQ identity on every frontend's input ROUTER."""
    return engine_index.to_bytes(2, "little")


@dataclasses.dataclass
class EngineGroupInfo:
    """What a frontend needs to reach a running group (picklable: the `jaxserve serve`
    launcher hands it to its API-server processes)."""

    config: Any  # EngineConfig, as engine 0 resolved it
    num_blocks: list[int]  # per engine
    clients: list[dict[str, str]]  # per client index: the input / output addresses it binds
    coordinator_front: str | None  # the coordinator's PUB of DPLoadState (None: one engine)
    engine_pids: list[int]
    core_timeline: list[tuple[str, float]]  # engine 0's start-up phases


def device_env(engine_index: int, data_parallel_size: int, tensor_parallel_size: int) -> dict:
    """The environment that gives engine `engine_index` its own GPUs (none with one engine)."""
    if data_parallel_size == 1:
        return {}
    tp = tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(data_parallel_size * tp)]
    mine = ids[engine_index * tp : (engine_index + 1) * tp]
    if len(mine) < tp:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tp} needs "
            f"{data_parallel_size * tp} GPUs; CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


class EngineGroup:
    """Starts the engines (and the coordinator), waits until every engine is READY; `poll()`
    says when one has died; `shutdown()` drains them (SIGTERM) and kills what is left."""

    def __init__(self, args: EngineArgs, clients: list[dict[str, str]], run_dir: str):
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen] = []
        self.envs: list[dict] = []
        self.coordinator: subprocess.Popen | None = None
        self.timeline = StartupTimeline()
        dp = args.data_parallel_size
        if dp < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {dp}")
        self.ctx = zmq.Context()
        handshake = self.ctx.socket(zmq.ROUTER)
        handshake.bind(f"ipc://{run_dir}/handshake")
        with open(os.path.join(run_dir, "engine_args.pkl"), "wb") as f:
            pickle.dump(args, f)
        coordinator = None
        try:
            if dp > 1:
                coordinator = coordinator_addresses(run_dir)
                self.coordinator = subprocess.Popen(
                    [sys.executable, "-m", "jaxserve.engine.coordinator", run_dir, str(dp)]
                )
            self.envs = [
                {**os.environ, **device_env(i, dp, args.tensor_parallel_size)} for i in range(dp)
            ]
            self._spawn(0)
            ready = self._handshake(handshake, clients, coordinator)
        except BaseException:
            self.shutdown()
            raise
        finally:
            handshake.close(linger=0)
        self.info = EngineGroupInfo(
            config=pickle.loads(ready[0]["config"]),
            num_blocks=[r["num_blocks"] for r in ready],
            clients=clients,
            coordinator_front=coordinator["front"] if coordinator else None,
            engine_pids=[p.pid for p in self.procs],
            core_timeline=[tuple(p) for p in ready[0]["timeline"]],
        )

    def _spawn(self, index: int) -> None:
        command = [sys.executable, "-m", "jaxserve.engine.core_proc", self.run_dir, str(index)]
        self.procs.append(subprocess.Popen(command, env=self.envs[index]))

    def _handshake(self, sock: zmq.Socket, clients: list[dict], coordinator) -> list[dict]:
        """Engine 0 first; the others once it is READY, so they load the step executables it
        compiled and saved instead of compiling the same shapes at once (each compile uses
        every host core)."""
        start = time.perf_counter()
        ready: dict[int, dict] = {}
        hello_s = 0.0
        while len(ready) < len(self.envs):
            if not sock.poll(HANDSHAKE_POLL_S * 1000):
                if (reason := self.poll()) is not None:
                    raise RuntimeError(f"EngineCore failed to start: {reason}")
                continue
            identity, payload = sock.recv_multipart()
            message = msgspec.msgpack.decode(payload)
            index = message.get("engine_index", 0)
            if message["status"] == "HELLO":
                addresses = {
                    "engine_index": index,
                    "inputs": [c["input"] for c in clients],
                    "outputs": [c["output"] for c in clients],
                    "coordinator": coordinator,
                }
                sock.send_multipart([identity, msgspec.msgpack.encode(addresses)])
                hello_s = max(hello_s, time.perf_counter() - start)
            elif message["status"] == "READY":
                ready[index] = message
                if index == 0:
                    for i in range(1, len(self.envs)):
                        self._spawn(i)
            else:
                raise RuntimeError(f"EngineCore failed to start: {message.get('error')}")
        # The core says HELLO once its engine config is built.
        config_s = dict(ready[0]["timeline"]).get("engine config", 0.0)
        self.timeline.add("engine core process (spawn, imports)", hello_s - config_s)
        self.timeline.extend("engine core: ", ready[0]["timeline"])
        return [ready[i] for i in range(len(self.envs))]

    def poll(self) -> str | None:
        """Why the group is broken (an engine or the coordinator exited), or None."""
        for i, proc in enumerate(self.procs):
            if (code := proc.poll()) is not None:
                name = "the process" if len(self.procs) == 1 else f"engine {i}'s process"
                return f"{name} exited with code {code}"
        if self.coordinator is not None and (code := self.coordinator.poll()) is not None:
            return f"the DP coordinator exited with code {code}"
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        shutdown_procs([*self.procs, self.coordinator], timeout)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def shutdown_procs(procs: list[subprocess.Popen | None], timeout: float = 10.0) -> None:
    """SIGTERM every process (a core finishes its in-flight work, then exits); kill those
    still running after timeout. Never leaves a core holding the devices."""
    procs = [p for p in procs if p is not None and p.poll() is None]
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
