"""The data-parallel load balancer of a frontend client: which engine gets each new request.

The DP coordinator (`engine/coordinator.py`) publishes every engine's waiting and running
counts (`DPLoadState`) on a PUB socket; a `LoadBalancer` reads them on a thread and picks
from them (used by `engine/core_client.py::SyncMPClient` with several engines).
"""

from __future__ import annotations

import threading

import msgspec
import zmq

from jaxserve.ipc.messages import DPLoadState

POLL_S = 0.5  # how often the reader thread checks that it should stop


class LoadBalancer:
    """Picks the data-parallel engine of each new request (vLLM's DPLBAsyncMPClient): the
    lowest waiting * 4 + running, from the counts the DP coordinator publishes (a thread
    reads its PUB socket), bumped here for every request sent until the next publication, so
    a burst between two publications spreads instead of piling onto one engine. Ties go to
    the first engine after this client's index, so API servers do not all pick engine 0."""

    def __init__(self, address: str, num_engines: int, client_index: int, client_count: int):
        self.counts = [[0, 0] for _ in range(num_engines)]
        self.wave, self.engines_running = 0, False
        self.client_index, self.client_count = client_index, client_count
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.received = threading.Event()  # a first DPLoadState has arrived
        self._thread = threading.Thread(
            target=self._read, args=(address,), daemon=True, name="dp-load"
        )
        self._thread.start()

    def _read(self, address: str) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        decoder = msgspec.msgpack.Decoder(DPLoadState)
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_S * 1000):
                    state = decoder.decode(sock.recv())
                    with self._lock:
                        self.counts = [list(c) for c in state.counts]
                        self.wave, self.engines_running = state.wave, state.engines_running
                    self.received.set()
        finally:
            sock.close()

    def pick(self, num_requests: int = 1) -> int:
        """The engine for the next request(s), counted as waiting there from now on."""
        with self._lock:
            n = len(self.counts)
            order = [(self.client_index + i) % n for i in range(n)]
            best = min(order, key=lambda i: self.counts[i][0] * 4 + self.counts[i][1])
            self.counts[best][0] += num_requests * self.client_count
            return best

    def all_idle(self) -> bool:
        """Whether the coordinator last saw every engine without work (and no wave running)."""
        with self._lock:
            return not self.engines_running and not any(w or r for w, r in self.counts)

    def stop(self) -> None:
        self._stop.set()
