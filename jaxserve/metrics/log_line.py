"""vLLM's periodic log line of serving throughput (one logger per data-parallel engine)."""

from __future__ import annotations

import logging
import time

from jaxserve.ipc.messages import SchedulerStats, SpecDecodingStats
from jaxserve.metrics.stats import IterationStats

logger = logging.getLogger(__name__)


class LoggingStatLogger:
    """vLLM's periodic line: prompt and generation throughput since the last line, running,
    waiting, KV-cache usage and prefix-cache hit rate; with speculative decoding, a second
    line with the drafts' acceptance since the last one. With several engines, one logger per
    engine (`PerEngineLogging`), each line prefixed "Engine 000: "."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.last_log = time.monotonic()
        self.prompt_tokens = self.generation_tokens = 0
        self.queries = self.hits = 0
        self.sched = SchedulerStats()
        self.spec: SpecDecodingStats | None = None

    def record(self, sched: SchedulerStats | None, it: IterationStats, engine: int = 0) -> None:
        if sched is not None:
            self.sched = sched
            self.queries += sched.prefix_cache_queries
            self.hits += sched.prefix_cache_hits
            if sched.spec_decoding is not None:
                self._add_spec(sched.spec_decoding)
        self.prompt_tokens += it.num_prompt_tokens
        self.generation_tokens += it.num_generation_tokens

    def log(self) -> str:
        now = time.monotonic()
        elapsed = max(now - self.last_log, 1e-9)
        s = self.sched
        hit_rate = 100 * self.hits / self.queries if self.queries else 0.0
        line = (
            f"{self.prefix}Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
            f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
        logger.info(line)
        if self.spec is not None:
            spec_line = self.prefix + self._spec_line(elapsed)
            logger.info(spec_line)
            line = f"{line}\n{spec_line}"
            self.spec = SpecDecodingStats()
        self.last_log, self.prompt_tokens, self.generation_tokens = now, 0, 0
        self.queries = self.hits = 0
        return line

    def _add_spec(self, stats: SpecDecodingStats) -> None:
        spec = self.spec = self.spec or SpecDecodingStats()
        spec.num_drafts += stats.num_drafts
        spec.num_draft_tokens += stats.num_draft_tokens
        spec.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = stats.num_accepted_tokens_per_pos
        spec.num_accepted_tokens_per_pos.extend(
            [0] * (len(per_pos) - len(spec.num_accepted_tokens_per_pos))
        )
        for pos, n in enumerate(per_pos):
            spec.num_accepted_tokens_per_pos[pos] += n

    def _spec_line(self, elapsed: float) -> str:
        s = self.spec
        drafts = max(s.num_drafts, 1)
        per_pos = ", ".join(f"{n / drafts:.3f}" for n in s.num_accepted_tokens_per_pos)
        rate = 100 * s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0
        return (
            f"SpecDecoding metrics: Mean acceptance length: "
            f"{1 + s.num_accepted_tokens / drafts:.2f}, "
            f"Accepted throughput: {s.num_accepted_tokens / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {s.num_draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {s.num_accepted_tokens} tokens, Drafted: {s.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: {rate:.1f}%"
        )


class PerEngineLogging:
    """The periodic lines of several data-parallel engines: a LoggingStatLogger each."""

    def __init__(self, num_engines: int):
        self.loggers = [LoggingStatLogger(f"Engine {i:03d}: ") for i in range(num_engines)]

    def record(self, sched: SchedulerStats | None, it: IterationStats, engine: int = 0) -> None:
        self.loggers[engine].record(sched, it)

    def log(self) -> str:
        return "\n".join(logger.log() for logger in self.loggers)


def make_log_stats(num_engines: int) -> LoggingStatLogger | PerEngineLogging:
    return LoggingStatLogger() if num_engines == 1 else PerEngineLogging(num_engines)
