"""The pooling APIs beyond embeddings, as vLLM serves them (its `serving_classification.py`,
`serving_score.py`, `serving_pooling.py`): /classify, /score and /v1/score, /rerank,
/v1/rerank and /v2/rerank, /pooling (bodies: openai/protocol_pooling.py).

Only a pooling server (--runner pooling) serves them; a generating one answers 400 naming
the flag. A classifier (*ForSequenceClassification) classifies and, with one label (a
cross-encoder), scores and reranks; an embedding model scores and reranks by cosine
similarity (what each task means: entrypoints/score_utils.py). Every prompt is validated
before anything is queued; each runs as one greedy one-token request, as /v1/embeddings'."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.config.pooler import is_classifier
from jaxserve.entrypoints import score_utils
from jaxserve.entrypoints.openai.api_common import generate_route
from jaxserve.entrypoints.openai.protocol import UsageInfo, random_id
from jaxserve.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

ONE_STEP = SamplingParams(max_tokens=1, temperature=0.0)


class OpenAIServingScore(OpenAIServing):
    def _check(self, model: str | None, api: str, task: str | None) -> None:
        """A base model's name (or none), on a pooling server whose model serves `task`."""
        if self.check_model(model) is not None:
            raise ValueError(
                f"`{model}` is a LoRA adapter: the {api} API serves the base model only; "
                "name it instead"
            )
        if self.engine.config.pooler is None:
            raise ValueError(
                f"The model does not support the {api} API (serve it --runner pooling)"
            )
        if task is not None:
            score_utils.check_task(self.engine.config, task)

    def _finish(self, request_id: str, prompts, priority: int):
        return self._gather(request_id, prompts, ONE_STEP, priority)

    # ------------------------------------------------------------------ /classify, /pooling
    def prepare_classify(self, request: ClassificationRequest):
        self._check(request.model, "Classification", "classify")
        request_id = random_id("classify")
        prompts = self.completion_prompts(request.input, "input")
        return request_id, self._validate(request_id, prompts, ONE_STEP)

    async def classify(self, request: ClassificationRequest, prepared) -> ClassificationResponse:
        request_id, prompts = prepared
        finals = await self._finish(request_id, prompts, request.priority)
        hf_config = self.engine.config.model.hf_config
        data = []
        for i, out in enumerate(finals):
            probs = score_utils.classify_probs(out.pooled, hf_config)
            data.append(
                ClassificationData(i, score_utils.label_of(probs, hf_config), probs, len(probs))
            )
        usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in finals), 0)
        return ClassificationResponse(
            request_id, int(time.time()), self._name(request.model), data, usage
        )

    def prepare_pooling(self, request: PoolingRequest):
        self._check(request.model, "Pooling", None)
        request_id = random_id("pool")
        prompts = self.completion_prompts(request.input, "input")
        return request_id, self._validate(request_id, prompts, ONE_STEP)

    async def pooling(self, request: PoolingRequest, prepared) -> PoolingResponse:
        request_id, prompts = prepared
        finals = await self._finish(request_id, prompts, request.priority)
        config = self.engine.config
        if is_classifier(config.model.architecture):
            vectors = [score_utils.classify_probs(o.pooled, config.model.hf_config) for o in finals]
        else:
            vectors = [PoolingParams().apply(o.pooled, config.pooler.normalize) for o in finals]
        data = [PoolingData(i, v) for i, v in enumerate(vectors)]
        usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in finals), 0)
        return PoolingResponse(request_id, int(time.time()), self._name(request.model), data, usage)

    # ------------------------------------------------------------------ /score, /rerank
    def _prepare_pairs(self, request_id: str, firsts: list[str], seconds: list[str]):
        """(request id, prompts, pairs, firsts embedded): a cross-encoder's one prompt per
        pair (firsts embedded 0), or a bi-encoder's texts, the first side once when it
        is one text."""
        config = self.engine.config
        if is_classifier(config.model.architecture):
            hf_config, prompts = config.model.hf_config, []
            for a, b in zip(firsts, seconds, strict=True):
                self.engine.input_processor.check_text_length(a + b)  # before tokenizing
                prompts.append(
                    (None, score_utils.cross_encoder_ids(self.tokenizer, hf_config, a, b))
                )
            embedded = 0
        else:
            texts = firsts[:1] if len(set(firsts)) == 1 else firsts
            prompts = [self.engine.input_processor.tokenize(t) for t in texts + seconds]
            embedded = len(texts)
        validated = self._validate(request_id, prompts, ONE_STEP)
        return request_id, validated, len(seconds), embedded

    async def _scores(self, prepared, priority: int) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens they took."""
        request_id, prompts, pairs, embedded = prepared
        finals = await self._finish(request_id, prompts, priority)
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        if not embedded:
            hf_config = self.engine.config.model.hf_config
            return [score_utils.cross_encoder_score(o.pooled, hf_config) for o in finals], tokens
        firsts, seconds = finals[:embedded], finals[embedded:]
        return [
            score_utils.cosine(firsts[i % embedded].pooled, seconds[i].pooled) for i in range(pairs)
        ], tokens

    def prepare_score(self, request: ScoreRequest):
        self._check(request.model, "Score", "score")
        firsts, seconds = score_utils.pair_up(request.text_1, request.text_2)
        return self._prepare_pairs(random_id("score"), firsts, seconds)

    async def score(self, request: ScoreRequest, prepared) -> ScoreResponse:
        scores, tokens = await self._scores(prepared, request.priority)
        data = [ScoreData(i, s) for i, s in enumerate(scores)]
        return ScoreResponse(
            prepared[0], int(time.time()), self._name(request.model), data, UsageInfo.of(tokens, 0)
        )

    def prepare_rerank(self, request: RerankRequest):
        self._check(request.model, "Rerank", "score")
        if request.top_n < 0:
            raise ValueError(f"top_n={request.top_n} must be >= 0 (0: every document)")
        firsts, seconds = score_utils.pair_up(
            request.query, request.documents, ("query", "documents")
        )
        return self._prepare_pairs(random_id("rerank"), firsts, seconds)

    async def rerank(self, request: RerankRequest, prepared) -> RerankResponse:
        scores, tokens = await self._scores(prepared, request.priority)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n or None]
        results = [RerankResult(i, RerankDocument(request.documents[i]), scores[i]) for i in order]
        return RerankResponse(
            prepared[0], self._name(request.model), RerankUsage(tokens, tokens), results
        )


async def classify(request: Request) -> Response:
    s = request.app.state.serving_score
    return await generate_route(
        request, ClassificationRequest, s.prepare_classify, s.classify, None
    )


async def score(request: Request) -> Response:
    s = request.app.state.serving_score
    return await generate_route(request, ScoreRequest, s.prepare_score, s.score, None)


async def rerank(request: Request) -> Response:
    s = request.app.state.serving_score
    return await generate_route(request, RerankRequest, s.prepare_rerank, s.rerank, None)


async def pooling(request: Request) -> Response:
    s = request.app.state.serving_score
    return await generate_route(request, PoolingRequest, s.prepare_pooling, s.pooling, None)


def score_routes() -> list[Route]:
    """The routes api_server.build_app serves these APIs on (vLLM's paths)."""
    post = ["POST"]
    return [
        Route("/classify", classify, methods=post),
        *(Route(path, score, methods=post) for path in ("/score", "/v1/score")),
        *(Route(path, rerank, methods=post) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        Route("/pooling", pooling, methods=post),
    ]
