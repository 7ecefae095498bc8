"""One model over several hosts: JAX's own distributed runtime, rank 0 leading.

`--nnodes N --node-rank R --master-addr A --master-port P`: every rank (one process per host)
calls `jax.distributed.initialize(A:P, N, R)` before touching a device, so `jax.devices()` is
the global list and the `tp` mesh spans every host (distributed/mesh.py takes
tensor_parallel_size / N devices of each). Collectives between hosts are XLA's (NCCL on GPU,
gloo on CPU): one SPMD program, run by every rank.

Rank 0 is the ordinary engine core (engine/core_proc.py): its scheduler decides every step.
Its runner sends each call that runs on the devices to the other ranks first, which make the
same call on their own runner (worker/multihost.py: `BroadcastRunner`, `run_follower`), so
every rank runs the same programs in the same order on the same host inputs. This module is
the channel the calls travel on: pickles (trusted hosts of one job) over ZeroMQ, rank 0
binding a ROUTER on P + 1 (`Leader`), each follower connecting a DEALER (`FollowerChannel`).

Failure: the call connection carries ZeroMQ's own heartbeats (every HEARTBEAT_S, answered by
the peer's ZeroMQ I/O thread, so a rank busy compiling with the GIL held still answers), and
each end watches it for a disconnect (a killed process: at once; a host gone silent: after
HEARTBEAT_TIMEOUT_S). Rank 0 that loses a follower calls its `on_lost` (the engine core
reports itself dead to the frontend, failing every request, and exits: a step waiting on the
lost rank's collective would never end); a follower that loses rank 0 exits (JAX's own
coordination service, hosted by rank 0, would end it too).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable

import jax
import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

CALL_PORT_OFFSET = 1
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 600.0  # followers load and compile as long as rank 0 does
LEADER_GRACE_S = 2.0  # for a follower to read rank 0's last message after it disconnects


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> None:
    """Join the JAX cluster of nnodes processes (blocks until all have joined); before any
    device is touched."""
    if "jax_cpu_collectives_implementation" in jax.config.values:  # collectives across hosts
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"{master_addr}:{master_port}",
        num_processes=nnodes,
        process_id=node_rank,
    )
    logger.info(
        "rank %d of %d: %d local devices, %d in all",
        node_rank,
        nnodes,
        jax.local_device_count(),
        jax.device_count(),
    )


def leave_cluster(timeout: float = 10.0) -> None:
    """jax.distributed.shutdown (every rank waits for the others there; without it, the ranks
    still in the cluster abort when its service, in rank 0, goes); bounded, in case a rank is
    gone."""
    done = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    done.start()
    done.join(timeout)


def _heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))


def _watch_disconnect(sock: zmq.Socket, on_lost: Callable[[str], None], what: str) -> None:
    """Call on_lost (in a thread) when a connection of `sock` closes."""
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def watch() -> None:
        while True:
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                on_lost(f"the connection to {what} closed")
                return

    threading.Thread(target=watch, daemon=True, name="rank-watch").start()


class Leader:
    """Rank 0's end of the call channel to every follower."""

    def __init__(self, nnodes: int, master_port: int, on_lost: Callable[[str], None]):
        self.num_followers = nnodes - 1
        self.on_lost = on_lost
        self.ctx = zmq.Context()
        self.calls = self.ctx.socket(zmq.ROUTER)
        self.calls.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _heartbeats(self.calls)
        self.calls.bind(f"tcp://*:{master_port + CALL_PORT_OFFSET}")
        self.followers: list[bytes] = []
        self.follower_blocks: dict[int, int] = {}  # rank -> the KV blocks its devices fit

    def wait_for_followers(self) -> None:
        """Every follower says it is loaded, with the KV blocks its devices fit (from then on a
        closed connection is a lost rank); ValueError if one's devices fit too few."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(self.followers) < self.num_followers:
            if not self.calls.poll(1000):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{len(self.followers)} of {self.num_followers} follower "
                        f"ranks joined in {JOIN_TIMEOUT_S:.0f} s"
                    )
                continue
            identity, frame = self.calls.recv_multipart()
            rank, num_blocks = pickle.loads(frame)
            if isinstance(num_blocks, str):  # its budget holds too few blocks
                raise ValueError(f"follower rank {rank}: {num_blocks}")
            self.followers.append(identity)
            self.follower_blocks[rank] = num_blocks
            logger.info("follower rank %d joined (its devices fit %d KV blocks)", rank, num_blocks)
        _watch_disconnect(self.calls, self.on_lost, "a follower rank")

    def send(self, message: tuple) -> None:
        frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for identity in self.followers:
            try:
                self.calls.send_multipart([identity, frame])
            except zmq.ZMQError as e:  # the follower's connection is gone
                self.on_lost(f"cannot reach follower rank {identity.decode()}: {e}")

    def close(self) -> None:
        """A clean end: the followers exit too (each leaves the JAX cluster with rank 0)."""
        self.calls.disable_monitor()
        self.send(("shutdown", (), {}, None))
        self.calls.close(linger=2000)
        leave_cluster()


class FollowerChannel:
    """A follower rank's end of the call channel: rank 0's calls, in order."""

    def __init__(self, rank: int, master_addr: str, master_port: int):
        self.rank = rank
        self.ctx = zmq.Context()
        self.calls = self.ctx.socket(zmq.DEALER)
        self.calls.setsockopt(zmq.IDENTITY, str(rank).encode())
        _heartbeats(self.calls)
        self.calls.connect(f"tcp://{master_addr}:{master_port + CALL_PORT_OFFSET}")
        self.ending = threading.Event()  # rank 0 said "shutdown": its going away is no loss

    def ready(self, num_blocks: int | str) -> None:
        """Tell rank 0 this rank is loaded, with the KV blocks its devices fit (or why they
        fit too few): from then on a lost rank 0 ends this process."""
        self.calls.send(pickle.dumps((self.rank, num_blocks)))
        _watch_disconnect(self.calls, self._lost_leader, "rank 0")

    def recv(self) -> tuple:
        """The next call: (name, args, kwargs, step); ("shutdown", ...) is rank 0's end."""
        message = pickle.loads(self.calls.recv())
        if message[0] == "shutdown":
            self.ending.set()
        return message

    def _lost_leader(self, reason: str) -> None:
        """Rank 0 is gone: exit (the main thread may be inside a collective), unless what
        closed the connection was rank 0's clean end, whose "shutdown" the main thread is
        reading."""
        if self.ending.wait(LEADER_GRACE_S):
            return
        logger.error("%s: the follower exits", reason)
        os._exit(1)
