"""The bodies of the pooling APIs beyond embeddings (vLLM's fields and defaults): /classify,
/score (/v1/score), /rerank (/v1/rerank, /v2/rerank: Jina's and Cohere's shape) and
/pooling. Served by openai/serving_score.py on a pooling server (--runner pooling)."""

from __future__ import annotations

from typing import Any

import msgspec

from jaxserve.entrypoints.openai.protocol import UsageInfo


class ClassificationRequest(msgspec.Struct, kw_only=True):
    """/classify: a classifier's probabilities per label for each input."""

    input: str | list[Any]  # str, list[str], list[int] or list[list[int]]
    model: str | None = None
    user: str | None = None
    priority: int = 0


class ClassificationData(msgspec.Struct):
    index: int
    label: str  # the most probable label's name (the config's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
    object: str = "list"


class ScoreRequest(msgspec.Struct, kw_only=True):
    """/score: each (text_1, text_2) pair's score; one text_1 pairs with every text_2."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None
    priority: int = 0


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo
    object: str = "list"


class RerankRequest(msgspec.Struct, kw_only=True):
    """/rerank: the documents by their score against the query, best first; top_n: keep
    that many (0: all)."""

    query: str
    documents: list[str]
    top_n: int = 0
    model: str | None = None
    user: str | None = None
    priority: int = 0


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct):
    index: int  # the document's index in the request
    document: RerankDocument
    relevance_score: float


class RerankUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class PoolingRequest(msgspec.Struct, kw_only=True):
    """/pooling: each input's pooled output as it is (an embedding model's vector,
    normalised as its pooler config says; a classifier's probabilities)."""

    input: str | list[Any]
    model: str | None = None
    user: str | None = None
    priority: int = 0


class PoolingData(msgspec.Struct):
    index: int
    data: list[float]
    object: str = "pooling"


class PoolingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: UsageInfo
    object: str = "list"
