"""EngineCoreProc: the engine core in its own process, behind ZeroMQ (vLLM V1's layout).

Started by the frontend's client with multiprocessing "spawn" (`run_engine_core`):

1. Handshake (DEALER): send HELLO, receive the input / output socket addresses; load the
   model, compile, allocate the KV cache (EngineCore.__init__); send READY with the number of
   KV blocks. A failure before READY is sent as FAILED with the error, then the process exits.
2. Input thread: DEALER socket -> decode -> input queue (aborts also go to an aborts queue, so
   they apply between a step's execution and its update).
3. Output thread: output queue -> encode (one reused buffer) -> PUSH socket.
4. Main thread, the busy loop: block on the input queue while idle, drain it, step, queue the
   outputs.

On a fatal error the core sends ENGINE_CORE_DEAD and exits 1. SIGTERM / SIGINT: stop taking new
requests (they finish at once as aborted), let the running ones finish for up to
`JAXSERVE_SHUTDOWN_TIMEOUT` seconds (default 30), abort the rest, exit 0. A watchdog thread
exits the process when the frontend that started it is gone.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from jaxserve import envs
from jaxserve.distributed import multihost
from jaxserve.distributed.multihost import Leader
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core import EngineCore
from jaxserve.engine.gc_heap import freeze_heap
from jaxserve.engine.launch import engine_identity
from jaxserve.ipc.messages import (
    ENGINE_CORE_DEAD,
    DPEngineState,
    DPWave,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from jaxserve.ipc.serialization import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 60.0
PARENT_POLL_S = 0.5
_WAKEUP = object()  # input-queue item that only wakes the busy loop (signals)
_WAVE = object()  # input-queue item: a DPWave from the coordinator
# Test-only hooks: the core raises in the model step after this many steps; every step sleeps
# this many seconds (so a test can act while requests are surely in flight).
FAULT_ENV = "JAXSERVE_TEST_FAIL_AFTER_STEPS"
STEP_DELAY_ENV = "JAXSERVE_TEST_STEP_DELAY_S"


class EngineCoreProc(EngineCore):
    def __init__(
        self, args: EngineArgs, handshake_address: str, parent_pid: int, engine_index: int = 0
    ):
        # The config is resolved here, in the process that owns the devices: the frontend
        # never initialises a JAX backend (on a GPU that would take its memory).
        self.parent_pid = parent_pid
        self.engine_index = engine_index
        _start_thread(self._watch_parent, name="parent-watch")
        start = time.perf_counter()
        config = args.create_engine_config()
        config_s = time.perf_counter() - start
        self.ctx = zmq.Context()
        self.handshake = self.ctx.socket(zmq.DEALER)
        self.handshake.connect(handshake_address)
        hello = {"status": "HELLO", "pid": os.getpid(), "engine_index": engine_index}
        self.handshake.send(msgspec.msgpack.encode(hello))
        if not self.handshake.poll(HANDSHAKE_TIMEOUT_S * 1000):
            raise TimeoutError("the frontend did not answer HELLO")
        addresses = msgspec.msgpack.decode(self.handshake.recv())

        self.leader = None  # the other ranks of a model over several hosts
        if config.parallel.nnodes > 1:
            self.leader = Leader(config.parallel.nnodes, args.master_port, self._lost_rank)
        super().__init__(config, self.leader, engine_index)
        self.timeline.phases.insert(0, ("engine config", config_s))

        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        # (client index, EngineCoreOutputs); None: a clean shutdown; ENGINE_CORE_DEAD: to all
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.num_clients = len(addresses["outputs"])
        self.req_client: dict[str, int] = {}  # request id -> its frontend (several frontends)
        self.shutdown_requested = False
        self.steps_until_fault = envs.JAXSERVE_TEST_FAIL_AFTER_STEPS
        self.step_delay_s = envs.JAXSERVE_TEST_STEP_DELAY_S
        self._init_data_parallel(addresses["coordinator"])
        ready = threading.Event()
        _start_thread(self._process_input_sockets, addresses["inputs"], ready, name="core-input")
        self.output_thread = _start_thread(
            self._process_output_sockets, addresses["outputs"], name="core-output"
        )
        if not ready.wait(HANDSHAKE_TIMEOUT_S):
            raise TimeoutError("the input socket did not connect")
        ready_message = {
            "status": "READY",
            "engine_index": engine_index,
            "num_blocks": self.num_blocks,
            "config": pickle.dumps(config),  # frozen dataclasses; a trusted local socket
            "timeline": self.timeline.phases,
        }
        self.handshake.send(msgspec.msgpack.encode(ready_message))

    def _init_data_parallel(self, coordinator: dict | None) -> None:
        """With data parallelism: a PUSH of this engine's load to the DP coordinator and a
        thread that turns its wave messages into input-queue items. Waves make idle engines
        run dummy steps only for a mixture of experts (as vLLM), whose engines' steps would
        meet in collectives once experts are spread over engines."""
        self.coordinator_push: zmq.Socket | None = None
        self.engines_running = False  # this engine's view of the DP wave
        self.wave_sync = coordinator is not None and bool(self.config.model.num_experts)
        self.num_dummy_steps = 0
        self._load_encoder = msgspec.msgpack.Encoder()
        self._last_load: tuple[int, int] | None = None
        if coordinator is None:
            return
        self.coordinator_push = self.ctx.socket(zmq.PUSH)
        self.coordinator_push.setsockopt(zmq.LINGER, 0)
        self.coordinator_push.connect(coordinator["in"])
        _start_thread(self._process_waves, coordinator["back"], name="core-waves")

    def _lost_rank(self, reason: str) -> None:
        """A rank of a multi-host model is gone: this core's step may wait forever on its
        collectives. Tell every frontend the core is dead (each request fails), then exit."""
        logger.error("%s: the engine core exits", reason)
        output_thread = getattr(self, "output_thread", None)
        if output_thread is not None:
            self.output_queue.put_nowait(ENGINE_CORE_DEAD)
            output_thread.join(timeout=5)
        os._exit(1)

    # ------------------------------------------------------------------ threads
    def _watch_parent(self) -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != self.parent_pid:
                logger.error("the frontend (pid %d) is gone; EngineCore exits", self.parent_pid)
                os._exit(1)

    def _process_input_sockets(self, addresses: list[str], ready: threading.Event) -> None:
        """One DEALER per frontend (its ROUTER routes to this engine by identity); each
        message is queued with the index of the frontend that sent it (an ADD's requests
        each). A batch of requests comes as one ADD: this thread takes the GIL once for it,
        not once per request (each time the busy loop's switch interval, 5 ms)."""
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(list[EngineCoreRequest]),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
        }
        poller, sockets = zmq.Poller(), {}
        for client_index, address in enumerate(addresses):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, engine_identity(self.engine_index))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send(b"")  # registers this DEALER with the frontend's ROUTER
            poller.register(sock, zmq.POLLIN)
            sockets[sock] = client_index
        ready.set()
        while True:
            for sock, _ in poller.poll():
                frames = sock.recv_multipart(copy=False)
                try:
                    request_type = EngineCoreRequestType(bytes(frames[0].buffer))
                    payload = decoders[request_type].decode(frames[1:])
                except Exception as e:  # a frontend's bug: its request fails, not this thread
                    self._refuse_undecodable(frames, e, sockets[sock])
                    continue
                if request_type == EngineCoreRequestType.ABORT:
                    self.aborts_queue.put_nowait(payload)
                for item in payload if request_type == EngineCoreRequestType.ADD else [payload]:
                    self.input_queue.put_nowait((request_type, item, sockets[sock]))

    def _refuse_undecodable(self, frames: list, error: Exception, client_index: int) -> None:
        """Fail the requests a message that does not decode was adding (their ids read
        loosely), or log it: the input thread goes on either way."""
        logger.error("an undecodable message from frontend %d: %r", client_index, error)
        try:
            requests = msgspec.msgpack.decode(frames[1].buffer)
            adding = bytes(frames[0].buffer) == EngineCoreRequestType.ADD
            ids = [r[0] for r in requests if isinstance(r[0], str)] if adding else []
        except Exception:
            ids = []
        why = f"{type(error).__name__}: {error}"
        if ids:
            failed = [EngineCoreOutput(request_id, [], "error", why) for request_id in ids]
            self.output_queue.put_nowait((client_index, EngineCoreOutputs(failed)))

    def _process_waves(self, address: str) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        decoder = msgspec.msgpack.Decoder(DPWave)
        while True:
            self.input_queue.put_nowait((_WAVE, decoder.decode(sock.recv()), 0))

    def _process_output_sockets(self, addresses: list[str]) -> None:
        encoder = MsgpackEncoder()
        # Its own context: terminating it waits (up to LINGER) until the last outputs and the
        # dead sentinel are delivered, which os._exit at the end of the process would not.
        ctx = zmq.Context()
        sockets = []
        for address in addresses:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 4000)
            sock.connect(address)
            sockets.append(sock)
        while True:
            item = self.output_queue.get()
            if item is None or item == ENGINE_CORE_DEAD:  # None: a clean shutdown
                for sock in sockets:
                    if item is not None:
                        sock.send(ENGINE_CORE_DEAD)
                    sock.close()
                ctx.term()
                return
            client_index, outputs = item
            outputs.engine_index = self.engine_index
            frames = encoder.encode(outputs)
            sock = sockets[client_index]
            # The reused main buffer is copied; large arrays go out zero-copy.
            sock.send(frames[0], zmq.SNDMORE if len(frames) > 1 else 0, copy=True)
            for i, frame in enumerate(frames[1:], 2):
                sock.send(frame, zmq.SNDMORE if i < len(frames) else 0, copy=False)

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        """A step's outputs, split by the frontend each request came from. The scheduler
        stats go to frontend 0 only (their counters are deltas: counted once; its gauges and
        log line are the ones to read), alone when none of its requests has news."""
        if self.num_clients == 1:
            self.output_queue.put_nowait((0, outputs))
            return
        parts: dict[int, list[EngineCoreOutput]] = {0: []}
        for out in outputs.outputs:
            parts.setdefault(self.req_client.get(out.request_id, 0), []).append(out)
            if out.finished:
                self.req_client.pop(out.request_id, None)
        for client_index, outs in parts.items():
            stats = outputs.scheduler_stats if client_index == 0 else None
            if outs or stats is not None:
                message = EngineCoreOutputs(outs, stats, outputs.timestamp)
                self.output_queue.put_nowait((client_index, message))

    # ------------------------------------------------------------------ the busy loop
    def run_busy_loop(self) -> None:
        shutdown_deadline = None
        while True:
            idle = not self.has_unfinished_requests()
            self._process_input_queue(block=idle and not (self.wave_sync and self.engines_running))
            if self.shutdown_requested:
                if shutdown_deadline is None:
                    timeout = envs.JAXSERVE_SHUTDOWN_TIMEOUT
                    shutdown_deadline = time.monotonic() + timeout
                    logger.info("shutting down: finishing in-flight requests (%.0f s)", timeout)
                if not self.has_unfinished_requests():
                    break
                if time.monotonic() > shutdown_deadline:
                    self._abort_and_report(list(self.scheduler.requests))
                    break
            if self.has_unfinished_requests():
                outputs = self.step()
                if outputs is not None:
                    self._send_outputs(outputs)
            elif self.wave_sync and self.engines_running:
                self.runner.dummy_step()  # others have work: this engine steps with them
                self.num_dummy_steps += 1
            self._report_load()
        self.output_queue.put_nowait(None)
        self.output_thread.join(timeout=5)
        if self.leader is not None:
            self.leader.close()  # the follower ranks exit too

    def _report_load(self) -> None:
        """Tell the DP coordinator this engine's queues when they changed; with work while
        the engines are paused, start a wave."""
        if self.coordinator_push is None:
            return
        load = (len(self.scheduler.waiting), len(self.scheduler.running))
        start_wave = self.has_unfinished_requests() and not self.engines_running
        if load == self._last_load and not start_wave:
            return
        self._last_load = load
        if start_wave:
            self.engines_running = True
        state = DPEngineState(self.engine_index, *load, start_wave=start_wave)
        self.coordinator_push.send(self._load_encoder.encode(state))

    def _process_input_queue(self, block: bool) -> None:
        while block and not self.shutdown_requested:
            try:  # a timeout, so signals (SIGTERM) are always seen promptly
                self._handle(*self.input_queue.get(timeout=1.0))
                break
            except queue.Empty:
                continue
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())

    def _handle(self, request_type: Any, payload: Any = None, client_index: int = 0) -> None:
        if request_type is _WAKEUP:
            return
        if request_type is _WAVE:
            self.engines_running = payload.running
            return
        if request_type == EngineCoreRequestType.ADD:
            if self.shutdown_requested:  # refused: finish it at once
                abort = EngineCoreOutput(payload.request_id, [], "abort")
                self.output_queue.put_nowait((client_index, EngineCoreOutputs([abort])))
            else:
                if self.num_clients > 1:
                    self.req_client[payload.request_id] = client_index
                self.add_request(payload)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
            if not self.has_unfinished_requests():  # no step will report the freed blocks
                self._send_outputs(EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats()))
        elif request_type == EngineCoreRequestType.UTILITY:
            reply = EngineCoreOutputs(utility_output=self._utility(payload))
            self.output_queue.put_nowait((client_index, reply))

    def _utility(self, call: UtilityRequest) -> UtilityOutput:
        method = self.utility(call.method)
        if call.method not in UTILITY_METHODS or method is None:
            return UtilityOutput(call.call_id, failure_message=f"no utility {call.method!r}")
        try:
            return UtilityOutput(call.call_id, result=method(*call.args))
        except Exception as e:  # reported to the caller; the core keeps serving
            return UtilityOutput(call.call_id, failure_message=f"{type(e).__name__}: {e}")

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        aborted = super().abort_requests(request_ids)
        for request_id in request_ids:
            self.req_client.pop(request_id, None)
        return aborted

    def _abort_and_report(self, request_ids: list[str]) -> None:
        clients = {r: self.req_client.get(r, 0) for r in request_ids}
        aborted = self.abort_requests(request_ids)
        for r in aborted:
            abort = EngineCoreOutput(r, [], finish_reason="abort")
            self.output_queue.put_nowait((clients[r], EngineCoreOutputs([abort])))

    def process_aborts_mid_step(self) -> None:
        while not self.aborts_queue.empty():
            self.abort_requests(self.aborts_queue.get_nowait())

    def step(self) -> EngineCoreOutputs:
        if self.steps_until_fault == 0:
            raise RuntimeError(f"injected fault ({FAULT_ENV})")
        self.steps_until_fault -= 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return super().step()

    def get_state(self) -> dict:
        return {
            **super().get_state(),
            "shutting_down": self.shutdown_requested,
            "engine_index": self.engine_index,
            "num_dummy_steps": self.num_dummy_steps,
        }

    def request_shutdown(self) -> None:
        self.shutdown_requested = True
        self.scheduling_paused = False  # requests paused in place finish (or are aborted)
        self.input_queue.put_nowait((_WAKEUP, None))


UTILITY_METHODS = frozenset({
    "reset_prefix_cache", "get_state", "add_lora", "remove_lora", "compile_status",
    # engine/core_control.py
    "sleep", "wake_up", "is_sleeping", "update_weights", "reload_weights", "weight_layout",
    "init_weight_transfer_engine", "start_weight_update", "update_weights_from",
    "finish_weight_update", "abort_all_requests", "pause_scheduler", "resume_scheduler",
    "collective_rpc",
})  # fmt: skip


def _start_thread(target, *args, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True, name=name)
    thread.start()
    return thread


def run_engine_core(
    args: EngineArgs, handshake_address: str, parent_pid: int, engine_index: int = 0
) -> None:
    """The core process's entry point."""
    name = f"EngineCore_DP{engine_index}" if args.data_parallel_size > 1 else "EngineCore"
    logging.basicConfig(
        level=envs.JAXSERVE_LOG_LEVEL,
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    logging.getLogger("jax").setLevel(logging.WARNING)
    core: EngineCoreProc | None = None
    try:
        if args.nnodes > 1:  # before any device is touched
            multihost.initialize(args.nnodes, 0, args.master_addr, args.master_port)
        core = EngineCoreProc(args, handshake_address, parent_pid, engine_index)
        signal.signal(signal.SIGTERM, lambda *_: core.request_shutdown())
        signal.signal(signal.SIGINT, lambda *_: core.request_shutdown())
        freeze_heap(collect=True)  # this process's heap, frozen for its life
        core.run_busy_loop()
    except Exception as e:
        if core is None:  # failed before READY: tell the frontend why
            logger.exception("EngineCore failed to start")
            _send_startup_failure(handshake_address, e)
        else:
            logger.exception("EngineCore hit a fatal error")
            core.output_queue.put_nowait(ENGINE_CORE_DEAD)  # to every frontend
            core.output_thread.join(timeout=5)
        os._exit(1)
    os._exit(0)  # daemon threads blocked in zmq calls would otherwise hold the exit


def _send_startup_failure(handshake_address: str, error: Exception) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(handshake_address)
    message = {"status": "FAILED", "error": f"{type(error).__name__}: {error}"}
    sock.send(msgspec.msgpack.encode(message))
    sock.close()


if __name__ == "__main__":
    # python -m jaxserve.engine.core_proc RUN_DIR ENGINE_INDEX: started by the engine group
    # (engine/launch.py), never by hand. A fresh interpreter (not multiprocessing) so the
    # user's __main__ module is never re-imported.
    run_dir = sys.argv[1]
    with open(os.path.join(run_dir, "engine_args.pkl"), "rb") as f:
        engine_args = pickle.load(f)
    run_engine_core(engine_args, f"ipc://{run_dir}/handshake", os.getppid(), int(sys.argv[2]))
