"""What the scheduler reports after each step (`SchedulerStats`, sent to the frontend with the
step's outputs: the metrics and the periodic log line): its queues, the KV cache, the prefix
cache's lookups, preemptions, drafts, a KV connector's counts and the LoRA adapters.

Waiting requests are counted as vLLM counts them: the queue and the requests parked while
their KV comes from another instance; of those, the deferred ones are held back by something
else than room in the batch (a grammar still compiling or an adapter with no slot, as the
last admission pass found them, and every request waiting for remote KV)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from jaxserve.core.scheduler_utils import lora_stats
from jaxserve.ipc.messages import SchedulerStats, SpecDecodingStats

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.kv_connector import SchedulerKVConnector
    from jaxserve.core.request import Request
    from jaxserve.core.request_queue import RequestQueue


class StatsSource(Protocol):
    """What make_stats reads of the scheduler (and resets: its counts since the last call)."""

    kv_cache_manager: KVCacheManager
    connector: SchedulerKVConnector | None
    running: list[Request]
    waiting: RequestQueue
    waiting_for_remote: dict[str, Request]
    max_loras: int
    num_preemptions: int  # since the last stats
    spec_stats: SpecDecodingStats | None  # since the last stats; None: no speculation
    num_skipped: int  # waiting requests the last admission pass went past (deferred)


def make_stats(sched: StatsSource) -> SchedulerStats:
    """The state now and the counts since the last call (which resets them): the Scheduler's
    `make_stats` method."""
    prefix = sched.kv_cache_manager.make_prefix_cache_stats()
    preemptions, sched.num_preemptions = sched.num_preemptions, 0
    spec, remote = sched.spec_stats, len(sched.waiting_for_remote)
    if spec is not None:
        sched.spec_stats = SpecDecodingStats()
    return SchedulerStats(
        num_running_reqs=len(sched.running),
        num_waiting_reqs=len(sched.waiting) + remote,
        kv_cache_usage=sched.kv_cache_manager.usage,
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        num_preemptions=preemptions,
        spec_decoding=spec,
        kv_connector=sched.connector.take_stats(),
        **lora_stats(sched.running, sched.waiting, sched.max_loras),
        # (a skipped request may have been aborted since the pass)
        num_deferred_reqs=min(sched.num_skipped, len(sched.waiting)) + remote,
    )
