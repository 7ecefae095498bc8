"""Whether AsyncLLM takes new requests: generation paused or resumed, the engine asleep or
awake (AsyncLLM's pause_generation, sleep, wake_up and their queries: vLLM's methods). The
gate owns that state; AsyncLLM's `generate` waits at it.

pause_generation(mode):
  "abort"  every in-flight request finishes at once with finish_reason "abort" (default)
  "wait"   the in-flight requests run to their end
  "keep"   they stay in the engine, their KV blocks kept, and continue on resume
While paused, new requests wait (in `generate`) until resume_generation; clear_cache empties
the prefix cache once the engine is idle (not with "keep", whose requests hold blocks). While
asleep (sleep until a full wake_up), new requests, and those waiting, fail at once with
EngineAsleepError (docs/rl.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sized
from typing import Any

from jaxserve.engine.exceptions import EngineAsleepError

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
DRAIN_POLL_S = 0.01


class GenerationGate:
    """Pause and sleep state of one AsyncLLM."""

    def __init__(self, call_utility: Callable[..., Awaitable[Any]], in_flight: Sized):
        """call_utility: the engine core client's utility call (name, *args); in_flight: the
        requests still running (AsyncLLM's collectors: a pause waits until it is empty)."""
        self.call_utility = call_utility
        self.in_flight = in_flight
        self._changed: asyncio.Event | None = None  # set (and replaced) on every change
        self._pause_mode: str | None = None
        self._paused_by_sleep = False
        self._asleep = False

    async def wait_until_resumed(self) -> None:
        """Where `generate` waits while generation is paused; EngineAsleepError at once
        while the engine sleeps (or once it falls asleep)."""
        while True:
            if self._asleep:
                raise EngineAsleepError()
            if self._pause_mode is None:
                return
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        """Wake the waiting requests to look at the state again."""
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating (modes above)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        if self._pause_mode is not None:
            return
        self._pause_mode = mode
        if mode == "keep":
            await self.call_utility("pause_scheduler")
            return
        if mode == "abort":
            await self.call_utility("abort_all_requests")
        while self.in_flight:  # aborted ones end with their next output
            await asyncio.sleep(DRAIN_POLL_S)
        if clear_cache:
            await self.call_utility("reset_prefix_cache")
        logger.info("generation paused (%s)", mode)

    async def resume(self) -> None:
        if self._pause_mode is None:
            return
        if self._pause_mode == "keep":
            await self.call_utility("resume_scheduler")
        self._pause_mode = None
        self._paused_by_sleep = False
        self._notify()
        logger.info("generation resumed")

    def is_paused(self) -> bool:
        return self._pause_mode is not None

    # ------------------------------------------------------------------ sleep
    async def sleep(self, level: int = 1) -> None:
        """Pause (aborting what runs, unless paused already), then free the device memory.
        From the start, requests fail at once (EngineAsleepError); if the engine cannot
        sleep, all is as before."""
        self._asleep = True
        self._notify()
        try:
            if self._pause_mode is None:
                await self.pause("abort")
                self._paused_by_sleep = True
            await self.call_utility("sleep", level)
        except Exception:
            await self._awake()
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake (the parts `tags` names); requests are taken again once all of it is awake."""
        await self.call_utility("wake_up", tags)
        if not await self.is_sleeping():
            await self._awake()

    async def _awake(self) -> None:
        self._asleep = False
        self._notify()
        if self._paused_by_sleep:
            await self.resume()

    async def is_sleeping(self) -> bool:
        return bool(await self.call_utility("is_sleeping"))  # (several engines: and-ed)
