"""What the server's dev-mode routes call on AsyncLLM (mixed into it): pause and resume
generation, sleep and wake, weight transfers and runner calls (vLLM's AsyncLLM methods).

pause_generation(mode):
  "abort"  every in-flight request finishes at once with finish_reason "abort" (default)
  "wait"   the in-flight requests run to their end
  "keep"   they stay in the engine, their KV blocks kept, and continue on resume
While paused, new requests wait (in `generate`) until resume_generation; clear_cache empties
the prefix cache once the engine is idle (not with "keep", whose requests hold blocks).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
DRAIN_POLL_S = 0.01


class AsyncControl:
    """Needs the AsyncLLM's `collectors` (requests in flight), `config` and `call_utility`."""

    _resumed: asyncio.Event | None = None
    _pause_mode: str | None = None
    _paused_by_sleep = False

    async def wait_until_resumed(self) -> None:
        """Where `generate` waits while generation is paused."""
        if self._resumed is not None:
            await self._resumed.wait()

    async def pause_generation(
        self, mode: str = "abort", clear_cache: bool = True, *,
        wait_for_inflight_requests: bool = False,
    ) -> None:  # fmt: skip
        """Stop generating (modes above); wait_for_inflight_requests: vLLM's older "wait"."""
        if wait_for_inflight_requests:
            mode = "wait"
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        if self._pause_mode is not None:
            return
        if self._resumed is None:
            self._resumed = asyncio.Event()
        self._resumed.clear()
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
        self._resumed.set()
        logger.info("generation resumed")

    async def is_paused(self) -> bool:
        return self._pause_mode is not None

    # ------------------------------------------------------------------ sleep
    async def sleep(self, level: int = 1) -> None:
        """Pause (aborting what runs, unless paused already), then free the device memory."""
        if self._pause_mode is None:
            await self.pause_generation("abort")
            self._paused_by_sleep = True
        await self.call_utility("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call_utility("wake_up", tags)
        if self._paused_by_sleep and not await self.is_sleeping():
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
        self, method: str, timeout: float | None = None, args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:  # fmt: skip
        """A model-runner method on every worker of every engine: their results."""
        call = self.call_utility("collective_rpc", method, list(args), kwargs or {})
        result = await asyncio.wait_for(call, timeout)
        if self.config.parallel.data_parallel_size > 1:  # one list per engine
            return [r for engine in result for r in engine]
        return result
