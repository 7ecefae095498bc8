"""What users get back: RequestOutput / CompletionOutput / Logprob, as in vLLM."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: {token_id: Logprob}, the sampled (or prompt) token included.
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None  # in the engine core
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first being scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    pooled: Any = None  # a pooling runner's f32[D] (LLM.embed turns it into an embedding)
    # Finished outputs only: what the engine's KV connector hands on (disaggregated prefill)
    kv_transfer_params: dict[str, Any] | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (the activated logits of the classifier's head)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per prompt (vLLM's)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """What LLM.score returns per text pair (vLLM's): prompt_token_ids are the pair's (a
    cross-encoder's one prompt; an embedding model's two, concatenated)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
