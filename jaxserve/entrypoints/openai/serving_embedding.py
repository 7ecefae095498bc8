"""/v1/embeddings (vLLM's `serving_embedding.py`): a pooling model's vector per input, as
floats or base64 little-endian float32, with `dimensions` and `normalize` applied."""

from __future__ import annotations

import base64
import time

import numpy as np

from jaxserve.entrypoints import score_utils
from jaxserve.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    UsageInfo,
    random_id,
)
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams


class OpenAIServingEmbedding(OpenAIServing):
    def prepare_embedding(self, request: EmbeddingRequest):
        if self.check_model(request.model) is not None:
            raise ValueError(
                f"`{request.model}` is a LoRA adapter: the Embeddings API serves the base model "
                "only; name it instead"
            )
        self.check_runner("Embeddings")
        score_utils.check_task(self.engine.config, "embed")  # not a classifier
        if request.encoding_format not in ("float", "base64"):
            raise ValueError(
                f"encoding_format {request.encoding_format!r} is not one of float, base64"
            )
        pooling = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        pooling.verify(self.engine.config.model.hidden_size)
        prompts = self.completion_prompts(request.input, "input")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        request_id = random_id("embd")
        return request_id, self._validate(request_id, prompts, params), params, pooling

    async def embedding(self, request: EmbeddingRequest, prepared) -> EmbeddingResponse:
        request_id, prompts, params, pooling = prepared
        finals = await self._gather(request_id, prompts, params, request.priority)
        default_normalize = self.engine.config.pooler.normalize
        data = []
        for i, out in enumerate(finals):
            vector = pooling.apply(out.pooled, default_normalize)
            if request.encoding_format == "base64":
                vector = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
            data.append(EmbeddingData(i, vector))
        usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in finals), 0)
        return EmbeddingResponse(
            request_id, int(time.time()), self._name(request.model), data, usage
        )
