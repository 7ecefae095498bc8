"""DPCoordinator: the one process that sees every data-parallel engine's load (vLLM V1's).

Started by the engine group (`engine/launch.py`) when data_parallel_size > 1, as
`python -m jaxserve.engine.coordinator RUN_DIR NUM_ENGINES`. Three sockets, bound under
RUN_DIR (`coordinator_addresses`):

    in     PULL  <- engines: DPEngineState after every step and every change of their queues
    front  PUB   -> frontends: DPLoadState, the [waiting, running] of every engine, for the
                    load balancer (at most every PUBLISH_INTERVAL_S while it changes, at once
                    when a wave starts or ends, and every REPUBLISH_S regardless, so a late
                    subscriber catches up)
    back   PUB   -> engines: DPWave, when a wave starts or ends

Waves (vLLM's request waves): the engines run together while any has work. An engine that gets
work while it believes the engines paused says so (start_wave); the coordinator then tells
every engine that the wave runs, and an engine with nothing to do runs dummy steps, so engines
whose steps would meet in collectives (a mixture of experts spread over engines) stay in step.
When every engine reports no work the wave ends: the wave number goes up and every engine
pauses. This is the one place that knows when all engines are idle.

The coordinator exits when the process that started it is gone.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import zmq

from jaxserve import envs
from jaxserve.ipc.messages import DPEngineState, DPLoadState, DPWave

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.05
REPUBLISH_S = 1.0
PARENT_POLL_S = 0.5


def coordinator_addresses(run_dir: str) -> dict[str, str]:
    """The coordinator's socket addresses (ipc:// under the engine group's run dir)."""
    return {name: f"ipc://{run_dir}/coordinator_{name}" for name in ("in", "front", "back")}


class DPCoordinator:
    """The coordinator's state machine (no sockets: `run` feeds it and sends what it says)."""

    def __init__(self, num_engines: int):
        self.counts = [[0, 0] for _ in range(num_engines)]
        self.wave = 0
        self.engines_running = False

    def update(self, state: DPEngineState) -> DPWave | None:
        """Take an engine's state; returns the wave message to send the engines, if any."""
        self.counts[state.engine_index] = [state.num_waiting, state.num_running]
        if state.start_wave and not self.engines_running:
            self.engines_running = True
            return DPWave(self.wave, running=True)
        if self.engines_running and self.all_idle():
            self.engines_running = False
            self.wave += 1
            return DPWave(self.wave, running=False)
        return None

    def all_idle(self) -> bool:
        return not any(w or r for w, r in self.counts)

    def load_state(self) -> DPLoadState:
        return DPLoadState([list(c) for c in self.counts], self.wave, self.engines_running)


def run(run_dir: str, num_engines: int, parent_pid: int) -> None:
    addresses = coordinator_addresses(run_dir)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addresses["in"])
    front = ctx.socket(zmq.PUB)
    front.bind(addresses["front"])
    back = ctx.socket(zmq.PUB)
    back.bind(addresses["back"])
    decoder = msgspec.msgpack.Decoder(DPEngineState)
    encoder = msgspec.msgpack.Encoder()
    coordinator = DPCoordinator(num_engines)
    last_published = last_parent_check = 0.0
    changed = True
    while True:
        if pull.poll(PUBLISH_INTERVAL_S * 1000):
            while True:
                try:
                    frame = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                wave = coordinator.update(decoder.decode(frame))
                changed = True
                if wave is not None:
                    back.send(encoder.encode(wave))
                    front.send(encoder.encode(coordinator.load_state()))
                    last_published, changed = time.monotonic(), False
        now = time.monotonic()
        due = changed and now - last_published >= PUBLISH_INTERVAL_S
        if due or now - last_published >= REPUBLISH_S:
            front.send(encoder.encode(coordinator.load_state()))
            if now - last_published >= REPUBLISH_S:  # engines that missed a wave catch up
                back.send(encoder.encode(DPWave(coordinator.wave, coordinator.engines_running)))
            last_published, changed = now, False
        if now - last_parent_check >= PARENT_POLL_S:
            last_parent_check = now
            if os.getppid() != parent_pid:
                logger.error("the process that started it is gone; the DP coordinator exits")
                return


if __name__ == "__main__":
    logging.basicConfig(
        level=envs.JAXSERVE_LOG_LEVEL,
        format="%(asctime)s %(levelname)s [DPCoordinator] %(name)s: %(message)s",
    )
    run(sys.argv[1], int(sys.argv[2]), os.getppid())
    os._exit(0)
