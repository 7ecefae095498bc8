"""What the scheduler reports after each step (`SchedulerStats`, sent to the frontend with the
step's outputs: the metrics and the periodic log line): its queues, the KV cache, the prefix
cache's lookups, preemptions, drafts, a KV connector's counts and the LoRA adapters.

Waiting requests are counted as vLLM counts them: the queue and the requests parked while
their KV comes from another instance; of those, the deferred ones are held back by something
else than room in the batch (a grammar still compiling or an adapter with no slot, as the
last admission pass found them, and every request waiting for remote KV)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.scheduler_utils import lora_stats
from jaxserve.ipc.messages import SchedulerStats, SpecDecodingStats

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.kv_connector import SchedulerKVConnector
    from jaxserve.core.request import Request
    from jaxserve.core.request_queue import RequestQueue


class StatsReport:
    """The Scheduler's make_stats (a mixin: the counters it reads are the scheduler's)."""

    kv_cache_manager: KVCacheManager
    connector: SchedulerKVConnector | None
    running: list[Request]
    waiting: RequestQueue
    waiting_for_remote: dict[str, Request]
    max_loras: int
    num_preemptions: int  # since the last stats
    spec_stats: SpecDecodingStats | None  # since the last stats; None: no speculation
    num_skipped: int = 0  # waiting requests the last admission pass went past (deferred)

    def make_stats(self) -> SchedulerStats:
        """The state now and the counts since the last call (which resets them)."""
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        preemptions, self.num_preemptions = self.num_preemptions, 0
        remote = len(self.waiting_for_remote)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + remote,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=preemptions,
            spec_decoding=self._take_spec_stats(),
            kv_connector=self.connector.take_stats(),
            **lora_stats(self.running, self.waiting, self.max_loras),
            # (a skipped request may have been aborted since the pass)
            num_deferred_reqs=min(self.num_skipped, len(self.waiting)) + remote,
        )

    def _take_spec_stats(self) -> SpecDecodingStats | None:
        stats = self.spec_stats
        self.spec_stats = SpecDecodingStats() if stats is not None else None
        return stats
