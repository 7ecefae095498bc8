"""How a pooling runner (embeddings) reduces a prompt's hidden states (`--pooler-config`)."""

from __future__ import annotations

import dataclasses

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a pooling runner (`runner="pooling"`) turns a prompt's final hidden states into one
    vector: the last token's (LAST, vLLM's default for decoder models), their mean (MEAN) or
    the first token's (CLS), L2-normalised unless `normalize` is off (per request:
    PoolingParams.normalize)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type {self.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}"
            )
