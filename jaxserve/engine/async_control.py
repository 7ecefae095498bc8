"""What the server's dev-mode routes call on AsyncLLM (mixed into it): pause and resume
generation, sleep and wake, weight transfers and runner calls (vLLM's AsyncLLM methods).

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
from typing import Any

from jaxserve.engine.exceptions import EngineAsleepError

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
DRAIN_POLL_S = 0.01


class AsyncControl:
    """Needs the AsyncLLM's `collectors` (requests in flight), `config` and `call_utility`."""

    _changed: asyncio.Event | None = None  # set (and replaced) when pause or sleep changes
    _pause_mode: str | None = None
    _paused_by_sleep = False
    _asleep = False

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

    async def pause_generation(
        self,
        mode: str = "abort",
        clear_cache: bool = True,
        *,
        wait_for_inflight_requests: bool = False,
    ) -> None:
        """Stop generating (modes above); wait_for_inflight_requests: vLLM's older "wait"."""
        if wait_for_inflight_requests:
            mode = "wait"
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
        while self.collectors:  # aborted ones end with their next output
            await asyncio.sleep(DRAIN_POLL_S)
        if clear_cache:
            await self.call_utility("reset_prefix_cache")
        logger.info("generation paused (%s)", mode)

    async def resume_generation(self) -> None:
        if self._pause_mode is None:
            return
        if self._pause_mode == "keep":
            await self.call_utility("resume_scheduler")
        self._pause_mode = None
        self._paused_by_sleep = False
        self._notify()
        logger.info("generation resumed")

    async def is_paused(self) -> bool:
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
                await self.pause_generation("abort")
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
            await self.resume_generation()

    async def is_sleeping(self) -> bool:
        return bool(await self.call_utility("is_sleeping"))  # (several engines: and-ed)

    # ------------------------------------------------------------------ weights
    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        await self.call_utility("init_weight_transfer_engine", init_info)

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        await self.call_utility("start_weight_update", is_checkpoint_format)

    async def update_weights(self, update_info: dict) -> None:
        """Stage the tensors `update_info` names (applied by finish_weight_update)."""
        await self.call_utility("update_weights_from", update_info)

    async def finish_weight_update(self) -> Any:
        return await self.call_utility("finish_weight_update")

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility("reset_prefix_cache"))

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """A model-runner method on every worker of every engine: their results. By name only
        (engine/core_control.py's COLLECTIVE_RPC_METHODS): functions are LLM.collective_rpc's,
        never sent from a server."""
        if not isinstance(method, str):
            raise ValueError(f"collective_rpc takes a method name, got {type(method).__name__}")
        call = self.call_utility("collective_rpc", method, list(args), kwargs or {})
        result = await asyncio.wait_for(call, timeout)
        if self.config.parallel.data_parallel_size > 1:  # one list per engine
            return [r for engine in result for r in engine]
        return result
