"""How the frontend talks to the engine core.

`EngineCoreClient` is the surface (add, abort, get the next outputs, utility calls);
`InprocClient` holds the EngineCore in the caller's process and steps it on `get_output()`. It is
kept for tests and debugging once the multi-process clients exist: same calls, no sockets.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core import EngineCore
from jaxserve.engine.startup import StartupTimeline
from jaxserve.ipc.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from jaxserve.ipc.serialization import MsgpackDecoder, MsgpackEncoder

PROC_POLL_S = 0.5  # how often the output reader checks that the core process lives


class EngineCoreClient(abc.ABC):
    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (empty when the core has nothing to do)."""

    @abc.abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run an EngineCore method (e.g. "reset_prefix_cache") and return its result."""

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:  # noqa: B027 (nothing to release in-process)
        pass


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig):
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step() or EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any) -> Any:
        if method.startswith("_") or not callable(getattr(self.engine_core, method, None)):
            raise ValueError(f"EngineCore has no utility method {method!r}")
        return getattr(self.engine_core, method)(*args)


class EngineDeadError(RuntimeError):
    """The engine core process is gone: every pending and future call fails with this."""

    def __init__(self, reason: str = "the engine core died"):
        super().__init__(f"EngineCore is dead ({reason}); see its log for the cause")


class SyncMPClient(EngineCoreClient):
    """The engine core in its own process, reached over ZeroMQ (used by `LLM` by default).

    Sockets (the frontend binds, the core connects, ipc:// under a private temp dir):
    handshake ROUTER, input ROUTER (ADD / ABORT / UTILITY frames to the core's DEALER), output
    PULL (EngineCoreOutputs, or the ENGINE_CORE_DEAD sentinel, from the core's PUSH). A reader
    thread decodes outputs into a queue and watches the process: whatever kills the core,
    waiters get EngineDeadError within PROC_POLL_S and new calls fail at once.
    """

    def __init__(self, args: EngineArgs):
        self.ctx = zmq.Context()
        self.run_dir = tempfile.mkdtemp(prefix="jaxserve-")
        self.dead: EngineDeadError | None = None
        self._lock = threading.Lock()  # the input socket is shared by the caller's threads
        self._calls = itertools.count()
        self._encoder = MsgpackEncoder()  # its buffer is reused: use it under _lock only
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self.proc: subprocess.Popen | None = None

        address = lambda name: f"ipc://{self.run_dir}/{name}"  # noqa: E731
        handshake = self.ctx.socket(zmq.ROUTER)
        handshake.bind(address("handshake"))
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises
        self.input_socket.bind(address("input"))
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(address("output"))
        with open(os.path.join(self.run_dir, "engine_args.pkl"), "wb") as f:
            pickle.dump(args, f)
        self.timeline = StartupTimeline()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.engine.core_proc", self.run_dir]
        )
        try:
            ready = self._handshake(handshake, {"input": address("input"),
                                                "output": address("output")})  # fmt: skip
            self.timeline.extend("engine core: ", ready["timeline"])
            self.config: EngineConfig = pickle.loads(ready["config"])
            self.num_blocks: int = ready["num_blocks"]
            # The core's input DEALER announces itself with an empty frame.
            while not self.input_socket.poll(1000):
                self._check_alive_during_startup()
            self.core_identity, _ = self.input_socket.recv_multipart()
        except BaseException:
            self.shutdown()
            raise
        finally:
            handshake.close(linger=0)
        self._start_reader()
        weakref.finalize(self, SyncMPClient._cleanup, self.proc, self.run_dir)

    # ------------------------------------------------------------------ start-up
    def _handshake(self, sock: zmq.Socket, addresses: dict) -> dict:
        start = time.perf_counter()
        while True:
            if not sock.poll(1000):
                self._check_alive_during_startup()
                continue
            identity, payload = sock.recv_multipart()
            message = msgspec.msgpack.decode(payload)
            if message["status"] == "HELLO":
                sock.send_multipart([identity, msgspec.msgpack.encode(addresses)])
                hello_s = time.perf_counter() - start
            elif message["status"] == "READY":
                # The core says HELLO once its engine config is built.
                config_s = dict(message["timeline"]).get("engine config", 0.0)
                self.timeline.add("engine core process (spawn, imports)", hello_s - config_s)
                return message
            else:
                raise RuntimeError(f"EngineCore failed to start: {message.get('error')}")

    def _check_alive_during_startup(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"EngineCore exited with code {code} during start-up")

    # ------------------------------------------------------------------ outputs
    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read_outputs, daemon=True,
                                        name="core-outputs")  # fmt: skip
        self._reader.start()

    def _read_outputs(self) -> None:
        decoder = MsgpackDecoder(EngineCoreOutputs)
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        while self.dead is None:
            try:
                ready = poller.poll(PROC_POLL_S * 1000)
            except zmq.ZMQError:  # closed by shutdown()
                return
            if not ready:
                self.poll_dead()
                continue
            self._process_frames(self.output_socket.recv_multipart(copy=False), decoder)

    def _process_frames(self, frames: list, decoder: MsgpackDecoder) -> None:
        if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
            self._set_dead("it hit a fatal error")
            return
        outputs = decoder.decode(frames)
        if outputs.utility_output is not None:
            self._resolve(outputs.utility_output)
        else:
            self._deliver(outputs)

    def poll_dead(self) -> EngineDeadError | None:
        """The error every caller gets once the core is gone (checks its process), or None."""
        if self.dead is None:
            code = self.proc.poll()
            if code is not None:
                self._set_dead(f"the process exited with code {code}")
        return self.dead

    def _resolve(self, reply: UtilityOutput) -> None:
        future = self._pending.pop(reply.call_id, None)
        if future is None or future.done():  # an async caller may have been cancelled
            return
        if reply.failure_message is not None:
            future.set_exception(RuntimeError(reply.failure_message))
        else:
            future.set_result(reply.result)

    def _set_dead(self, reason: str) -> None:
        self.dead = EngineDeadError(reason)
        self._deliver(self.dead)
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(self.dead)
        self._pending.clear()

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self.outputs.put_nowait(item)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if isinstance(item, EngineDeadError):
            self.outputs.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    # ------------------------------------------------------------------ requests in
    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self.dead is not None:
            raise self.dead
        with self._lock:
            frames = self._encoder.encode(payload)
            try:
                self.input_socket.send_multipart(
                    [self.core_identity, request_type.value, bytes(frames[0]), *frames[1:]]
                )
            except zmq.ZMQError as e:  # the core's socket is gone: so is the core
                raise EngineDeadError(f"cannot reach it: {e}") from e

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._calls)
        self._pending[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        return future.result()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 10.0) -> None:
        """SIGTERM the core (it finishes in-flight work, then exits); kill it after timeout."""
        if self.dead is None:
            self.dead = EngineDeadError("the client was shut down")
        SyncMPClient._cleanup(self.proc, self.run_dir, timeout)
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join()  # it sees `dead` within PROC_POLL_S; then no thread uses a socket
        self.ctx.destroy(linger=0)

    @staticmethod
    def _cleanup(proc, run_dir, timeout: float = 10.0) -> None:
        """Also the finalizer: never leave a core process holding the devices."""
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


class AsyncMPClient(SyncMPClient):
    """SyncMPClient for asyncio callers: the output PULL socket is read on the event loop
    (zmq.asyncio) by one task, started by the first async call, which also checks the core
    process every PROC_POLL_S; sends never block (ZeroMQ queues them)."""

    def _start_reader(self) -> None:
        self._reader_task: asyncio.Task | None = None
        self._async_socket: zmq.asyncio.Socket | None = None
        self._queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()

    def _ensure_reader(self) -> None:
        if self._reader_task is None:
            self._async_socket = zmq.asyncio.Socket.from_socket(self.output_socket)
            self._reader_task = asyncio.get_running_loop().create_task(self._read_outputs_async())

    async def _read_outputs_async(self) -> None:
        decoder = MsgpackDecoder(EngineCoreOutputs)
        sock = self._async_socket
        with contextlib.suppress(zmq.ZMQError):  # closed by shutdown()
            while self.dead is None:
                if not await sock.poll(PROC_POLL_S * 1000):
                    self.poll_dead()
                    continue
                self._process_frames(await sock.recv_multipart(copy=False), decoder)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._queue.put_nowait(item)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        item = await self._queue.get()
        if isinstance(item, EngineDeadError):
            self._queue.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_reader()
        future = asyncio.get_running_loop().create_future()
        call_id = next(self._calls)
        self._pending[call_id] = future
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        except EngineDeadError:
            self._pending.pop(call_id, None)
            raise
        return await future

    def get_output(self) -> EngineCoreOutputs:
        raise TypeError("AsyncMPClient is read on the event loop: use get_output_async()")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise TypeError("AsyncMPClient is read on the event loop: use call_utility_async()")

    def shutdown(self, timeout: float = 10.0) -> None:
        if getattr(self, "_reader_task", None) is not None:
            self._reader_task.cancel()
            self._async_socket.close(linger=0)
        super().shutdown(timeout)
