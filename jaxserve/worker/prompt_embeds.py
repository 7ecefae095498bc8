"""Prompt embeddings (`--enable-prompt-embeds`) through the encoder cache that image models use:
a prompt given as embeddings [P, D] travels as one multimodal feature over P placeholder
tokens (engine/input_processor.py); the scheduler gives it P rows of the encoder cache when
its tokens are first scheduled (core/encoder_cache_manager.py), this runner writes the
embeddings there (its "encoder" is the identity: one compiled scatter per padded length), and
the forward reads each placeholder token's row instead of its embedding (encoder_runner.py's
`mm_rows`). Its prefix-cache key is the embeddings' content hash."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxserve.multimodal.inputs import MultiModalFeature
from jaxserve.worker.encoder_runner import EncoderRunner

MIN_BUCKET = 16  # the smallest padded prompt length; then powers of two up to max_model_len


def write_rows(params, buffer: jax.Array, inputs: dict, rows: jax.Array) -> jax.Array:
    """embeds [n, D] written at `rows` of the cache buffer [C, D] (C: padding, dropped)."""
    return buffer.at[rows].set(inputs["embeds"].astype(buffer.dtype), mode="drop")


class PromptEmbedsInputs:
    """The hooks EncoderRunner asks a model class for, for embeddings instead of images
    (mm_config: the hidden size)."""

    @staticmethod
    def encoder_buckets(hidden_size: int, max_len: int) -> dict[str, tuple[int, dict]]:
        sizes, n = [], MIN_BUCKET
        while True:
            sizes.append(min(n, max_len))
            if n >= max_len:
                break
            n *= 2
        return {
            f"embeds{n}": (n, {"embeds": np.zeros((n, hidden_size), np.float32)}) for n in sizes
        }

    @staticmethod
    def encoder_bucket(hidden_size: int, data: dict, buckets: dict) -> str:
        for name, (n, _) in buckets.items():
            if len(data["embeds"]) <= n:
                return name
        raise ValueError(f"prompt_embeds of {len(data['embeds'])} positions exceed the longest")

    @classmethod
    def encoder_inputs(cls, hidden_size: int, data: dict, buckets: dict) -> tuple[str, dict]:
        name = cls.encoder_bucket(hidden_size, data, buckets)
        padded = np.zeros((buckets[name][0], hidden_size), np.float32)
        padded[: len(data["embeds"])] = data["embeds"]
        return name, {"embeds": padded}


class PromptEmbedsRunner(EncoderRunner):
    def __init__(
        self, model: Any, max_num_batched_tokens: int, max_num_reqs: int, max_model_len: int, mesh
    ):
        """The cache holds max(max_num_batched_tokens, max_model_len) rows: a whole prompt's
        embeddings are written when its first tokens run, as an image's are."""
        self.model_cls = PromptEmbedsInputs
        self.mm_config = model.config.hidden_size
        self.buckets = PromptEmbedsInputs.encoder_buckets(self.mm_config, max_model_len)
        self.bidirectional = self.uses_mrope = False
        self._allocate(model.config, max_num_batched_tokens, max_num_reqs, max_model_len, mesh)

    def jit(self, model_def) -> Any:
        return jax.jit(write_rows, donate_argnums=(1,), out_shardings=self._rep)

    def check(self, feature: MultiModalFeature) -> None:
        """ValueError when no compiled length holds the prompt's embeddings."""
        self.model_cls.encoder_bucket(self.mm_config, feature.data, self.buckets)
