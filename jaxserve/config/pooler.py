"""How a pooling runner (embeddings, classifiers) reduces a prompt's hidden states
(`--pooler-config`), and what a classifier (HF `*ForSequenceClassification`) is."""

from __future__ import annotations

import dataclasses

POOLING_TYPES = ("LAST", "MEAN", "CLS")
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def is_classifier(architecture: str) -> bool:
    """A sequence classifier (models/seq_cls.py): a score head over the pooled vector."""
    return architecture.endswith(CLASSIFIER_SUFFIX)


def num_labels(hf_config: object) -> int:
    """A classifier's outputs: the length of HF's `id2label` (`num_labels` is derived from it)."""
    id2label = getattr(hf_config, "id2label", None) or {}
    return len(id2label) or int(getattr(hf_config, "num_labels", None) or 2)


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
