"""Messages between the frontend and the engine core (msgspec Structs, msgpack on the wire)."""

from __future__ import annotations

import msgspec

from jaxserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request: what the input processor sends to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (stop strings: frontend)
    # (logprobs [K+1], token ids [K+1], sampled rank): the sampled token first, then top-K.
    logprobs: tuple[list[float], list[int], int] | None = None
    # With the first token only: prompt positions 1.. as ([[lp]], [[token ids]], [rank]), each
    # row the prompt token first, then the top prompt_logprobs tokens.
    prompt_logprobs: tuple[list[list[float]], list[list[int]], list[int]] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up since the last stats
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0  # since the last stats


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one engine-core step sends back: every request's news plus the scheduler's state."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
