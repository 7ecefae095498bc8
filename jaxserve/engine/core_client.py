"""How the frontend talks to the engine core.

`EngineCoreClient` is the surface (add, abort, get the next outputs, utility calls);
`InprocClient` holds the EngineCore in the caller's process and steps it on `get_output()`. It is
kept for tests and debugging once the multi-process clients exist: same calls, no sockets.
The data-parallel load balancer is `engine/load_balancer.py`, the errors `engine/exceptions.py`.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.engine.launch import EngineGroup, EngineGroupInfo, client_addresses, engine_identity
from jaxserve.engine.load_balancer import LoadBalancer
from jaxserve.ipc.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from jaxserve.ipc.serialization import MsgpackDecoder, MsgpackEncoder
from jaxserve.startup import StartupTimeline

if TYPE_CHECKING:
    from jaxserve.engine.core import EngineCore

PROC_POLL_S = 0.5  # how often the output reader checks that the core process lives


class EngineCoreClient(abc.ABC):
    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Requests that belong together (a request's n > 1 children)."""
        self.add_request_groups([requests])

    def add_request_groups(self, groups: list[list[EngineCoreRequest]]) -> None:
        """Many requests at once (a generate() call's), each group as add_requests'."""
        for request in (r for group in groups for r in group):
            self.add_request(request)

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
    def __init__(self, config: EngineConfig, engine_core: EngineCore | None = None):
        """engine_core: one built already (e.g. over a runner with its own executable
        registry); by default this client builds it."""
        if engine_core is None:
            # Imported here: the engine core brings the model runner, spec decode and the
            # kernels, which a frontend whose core runs in another process must not import.
            from jaxserve.engine.core import EngineCore

            engine_core = EngineCore(config)
        self.engine_core = engine_core

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step() or EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any) -> Any:
        call = self.engine_core.utility(method)
        if call is None:
            raise ValueError(f"EngineCore has no utility method {method!r}")
        return call(*args)


class SyncMPClient(EngineCoreClient):
    """The engine cores in their own processes, reached over ZeroMQ (used by `LLM` by default).

    With `args`, this client starts the engines (`engine/launch.py::EngineGroup`: one, or
    data_parallel_size and the DP coordinator) and is their only frontend; with `group`, it
    joins engines a `jaxserve serve` launcher started for several API servers, as frontend
    `client_index`.

    Sockets (this client binds, every engine connects, ipc:// under a private temp dir):
    input ROUTER (ADD / ABORT / UTILITY frames to an engine's DEALER, by the engine's
    identity), output PULL (EngineCoreOutputs, or the ENGINE_CORE_DEAD sentinel, from every
    engine's PUSH). A reader thread decodes outputs into a queue and watches the engines:
    whatever kills one, waiters get EngineDeadError within PROC_POLL_S and new calls fail at
    once (with data parallelism too: vLLM's behaviour; a server then exits). With several
    engines each new request goes to the one the LoadBalancer picks (n > 1 children to the same
    one, which shares their prompt's blocks), aborts go to the engine holding the request, and
    utility calls go to every engine (their results combined: `combine_results`).
    """

    def __init__(
        self,
        args: EngineArgs | None = None,
        *,
        group: EngineGroupInfo | None = None,
        client_index: int = 0,
    ):
        self.ctx = zmq.Context()
        self.dead: EngineDeadError | None = None
        self._lock = threading.Lock()  # the input socket is shared by the caller's threads
        self._calls = itertools.count()
        self._encoder = MsgpackEncoder()  # its buffer is reused: use it under _lock only
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self.group: EngineGroup | None = None  # the engines, when this client started them
        self.client_index = client_index
        self.req_engine: dict[str, int] = {}  # request id -> its engine (several engines)
        self.load_balancer: LoadBalancer | None = None
        self._parent_pid = os.getppid()
        self.run_dir = tempfile.mkdtemp(prefix="jaxserve-") if group is None else None
        addresses = (
            client_addresses(self.run_dir, 1)[0] if group is None else group.clients[client_index]
        )
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises
        self.input_socket.bind(addresses["input"])
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(addresses["output"])
        try:
            if group is None:
                self.group = EngineGroup(args, [addresses], self.run_dir)
                self._finalizer = weakref.finalize(self, self.group.shutdown)
                group, self.timeline = self.group.info, self.group.timeline
            else:
                self.timeline = StartupTimeline()
            self.info = group
            self.config: EngineConfig = group.config
            self.num_blocks: int = group.num_blocks[0]
            self.engines = [engine_identity(i) for i in range(len(group.engine_pids))]
            self._await_engines()
            if group.coordinator_front is not None:
                self.load_balancer = LoadBalancer(
                    group.coordinator_front, len(self.engines), client_index, len(group.clients)
                )
        except BaseException:
            self.shutdown()
            raise
        self._start_reader()

    @property
    def proc(self) -> subprocess.Popen | None:
        """The (first) engine core process, when this client started it."""
        return self.group.procs[0] if self.group is not None else None

    # ------------------------------------------------------------------ start-up
    def _await_engines(self) -> None:
        """Every engine's input DEALER announces itself with an empty frame: wait for all."""
        waiting = set(self.engines)
        while waiting:
            if not self.input_socket.poll(1000):
                if (reason := self._broken()) is not None:
                    raise RuntimeError(f"EngineCore failed to start: {reason}")
                continue
            identity, _ = self.input_socket.recv_multipart()
            waiting.discard(identity)

    def _broken(self) -> str | None:
        if self.group is not None:
            return self.group.poll()
        if os.getppid() != self._parent_pid:
            return "the process that started the engines is gone"
        return None

    # ------------------------------------------------------------------ outputs
    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read_outputs, daemon=True, name="core-outputs")
        self._reader.start()

    def _read_outputs(self) -> None:
        decoder = MsgpackDecoder(EngineCoreOutputs)
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        checked = time.monotonic()
        while self.dead is None:
            try:
                ready = poller.poll(PROC_POLL_S * 1000)
            except zmq.ZMQError:  # closed by shutdown()
                return
            if ready:
                self._process_frames(self.output_socket.recv_multipart(copy=False), decoder)
            # (another engine's steady outputs must not hide a dead one)
            if time.monotonic() - checked >= PROC_POLL_S:
                checked = time.monotonic()
                self.poll_dead()

    def _process_frames(self, frames: list, decoder: MsgpackDecoder) -> None:
        if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
            self._set_dead("it hit a fatal error")
            return
        outputs = decoder.decode(frames)
        if outputs.utility_output is not None:
            self._resolve(outputs.utility_output)
            return
        if len(self.engines) > 1:
            for out in outputs.outputs:
                if out.finished:
                    self.req_engine.pop(out.request_id, None)
        self._deliver(outputs)

    def poll_dead(self) -> EngineDeadError | None:
        """The error every caller gets once an engine is gone (checks the processes), or None."""
        if self.dead is None and (reason := self._broken()) is not None:
            self._set_dead(reason)
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
    def _send(self, engine: int, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self.dead is not None:
            raise self.dead
        with self._lock:
            frames = self._encoder.encode(payload)
            try:
                self.input_socket.send_multipart(
                    [self.engines[engine], request_type.value, bytes(frames[0]), *frames[1:]]
                )
            except zmq.ZMQError as e:  # the core's socket is gone: so is the core
                raise EngineDeadError(f"cannot reach it: {e}") from e

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_request_groups(self, groups: list[list[EngineCoreRequest]]) -> None:
        """One ADD message per engine for the groups it gets (a group: one engine)."""
        by_engine: dict[int, list[EngineCoreRequest]] = {}
        for requests in groups:
            engine = self._engine_for(requests)
            for request in requests:
                request.client_index = self.client_index
                if len(self.engines) > 1:
                    self.req_engine[request.request_id] = engine
            by_engine.setdefault(engine, []).extend(requests)
        for engine, requests in by_engine.items():
            self._send(engine, EngineCoreRequestType.ADD, requests)

    def _engine_for(self, requests: list[EngineCoreRequest]) -> int:
        rank = requests[0].data_parallel_rank
        if rank is not None:
            if not 0 <= rank < len(self.engines):
                raise ValueError(
                    f"data_parallel_rank {rank} is out of range: there are {len(self.engines)} "
                    "data-parallel engines"
                )
            return rank
        return 0 if self.load_balancer is None else self.load_balancer.pick(len(requests))

    def engine_of(self, request_id: str) -> int:
        """The engine running a request (0 when unknown or finished)."""
        return self.req_engine.get(request_id, 0)

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead is not None:
            return
        if len(self.engines) == 1:
            self._send(0, EngineCoreRequestType.ABORT, list(request_ids))
            return
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.req_engine.pop(request_id, None)
            if engine is not None:  # else: finished, or never added
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            self._send(engine, EngineCoreRequestType.ABORT, ids)

    def _send_utility(self, method: str, args: tuple, make_future) -> list:
        """Send the call to every engine; one future per engine."""
        futures = []
        for engine in range(len(self.engines)):
            future = make_future()
            call_id = next(self._calls)
            self._pending[call_id] = future
            try:
                request = UtilityRequest(call_id, method, list(args))
                self._send(engine, EngineCoreRequestType.UTILITY, request)
            except Exception:  # a dead engine, or arguments the wire cannot carry
                self._pending.pop(call_id, None)
                raise
            futures.append(future)
        return futures

    def call_utility(self, method: str, *args: Any) -> Any:
        futures = self._send_utility(method, args, concurrent.futures.Future)
        return combine_results([f.result() for f in futures])

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 10.0) -> None:
        """Started here: SIGTERM the cores (each finishes its in-flight work, then exits)
        and kill what is left after timeout. Joined: the launcher stops them."""
        if self.dead is None:
            self.dead = EngineDeadError("the client was shut down")
        elif self.group is not None and self.group.poll() is not None:
            timeout = min(timeout, 1.0)  # an engine died: the others' requests are lost anyway
        if self.load_balancer is not None:
            self.load_balancer.stop()
        if self.group is not None:
            self.group.shutdown(timeout)
        elif self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join()  # it sees `dead` within PROC_POLL_S; then no thread uses a socket
        self.ctx.destroy(linger=0)


def combine_results(results: list) -> Any:
    """Utility results of every engine as one: a single engine's as it is; several engines'
    dicts with their counts ("num_*", "total_*") summed, their flags or-ed, and every engine's
    dict under "engines"; booleans and-ed (e.g. reset_prefix_cache); anything else as the list."""
    if len(results) == 1:
        return results[0]
    if all(isinstance(r, bool) for r in results):
        return all(results)
    if all(isinstance(r, dict) for r in results):
        merged: dict[str, Any] = {}
        for key, value in results[0].items():
            values = [r.get(key) for r in results]
            if isinstance(value, bool):
                merged[key] = any(values)
            elif key.startswith(("num_", "total_")):
                merged[key] = sum(values)
            else:
                merged[key] = values
        merged["engines"] = results
        return merged
    return results


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
        checked = time.monotonic()
        with contextlib.suppress(zmq.ZMQError):  # closed by shutdown()
            while self.dead is None:
                if await sock.poll(PROC_POLL_S * 1000):
                    self._process_frames(await sock.recv_multipart(copy=False), decoder)
                if time.monotonic() - checked >= PROC_POLL_S:  # as _read_outputs
                    checked = time.monotonic()
                    self.poll_dead()

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
        futures = self._send_utility(method, args, asyncio.get_running_loop().create_future)
        return combine_results(list(await asyncio.gather(*futures)))

    def get_output(self) -> EngineCoreOutputs:
        raise TypeError("AsyncMPClient is read on the event loop: use get_output_async()")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise TypeError("AsyncMPClient is read on the event loop: use call_utility_async()")

    def shutdown(self, timeout: float = 10.0) -> None:
        if getattr(self, "_reader_task", None) is not None:
            self._reader_task.cancel()
            self._async_socket.close(linger=0)
        super().shutdown(timeout)
