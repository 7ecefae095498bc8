"""What one batch of core outputs meant for the frontend's requests, as the OutputProcessor
fills it for the stat loggers (prometheus.py, log_line.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    max_generation_tokens: int = 0  # the longest child's (n > 1)
    prefill_time: float | None = None  # first scheduled -> first token
    decode_time: float | None = None  # first token -> last token
    inference_time: float | None = None  # first scheduled -> last token
    num_preemptions: int = 0  # times its requests were preempted (its children's summed)
    n: int | None = None  # its sampling parameters (None: a pooling request, which has none)
    max_tokens: int | None = None


@dataclasses.dataclass
class IterationStats:
    """What one batch of core outputs meant for the frontend's requests."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token
    num_computed_prompt_tokens: int = 0  # of those, the ones not found in a cache
    num_generation_tokens: int = 0
    engine_step: bool = False  # it holds an engine step's outputs (not an abort's alone)
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished: list[FinishedRequestStats] = dataclasses.field(default_factory=list)
