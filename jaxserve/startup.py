"""The start-up timeline: one log line per phase as it ends ("start-up: <phase> <s> s"), so a
slow start shows where its seconds went. The engine core sends its phases to the frontend in
its READY message; `jaxserve serve` logs the whole timeline once it is ready, and
benchmarks/bench_startup.py reads these lines."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


class StartupTimeline:
    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []  # (phase, seconds), in the order they ended

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.phases.append((name, seconds))
        logger.info("start-up: %s %.2f s", name, seconds)

    def extend(self, prefix: str, phases: list[tuple[str, float]]) -> None:
        """Phases measured elsewhere (the engine core's), already logged there."""
        self.phases.extend((f"{prefix}{name}", seconds) for name, seconds in phases)

    def summary(self) -> str:
        return "; ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
