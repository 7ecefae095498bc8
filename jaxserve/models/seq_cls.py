"""Sequence classifiers (HF `*ForSequenceClassification`): a decoder whose `score` head
[hidden, num_labels] reads the final hidden state of a prompt's LAST token, as transformers'
`Qwen3ForSequenceClassification` does (cross-encoder rerankers are this with num_labels 1).

The decoder is the causal LM's (its checkpoint names are the same, under `model.`); the
classifier has no LM head. It runs only on a pooling runner (`runner="pooling"`): the pooler
pools the last token's hidden state and applies `classifier_head` to it
(worker/pooler.py), and the frontend applies the activation
(entrypoints/score_utils.py). The one token a pooling request samples (and drops) is read
off the tied embedding table: ModelConfig.from_hf ties the embeddings of every classifier.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.config.pooler import num_labels
from jaxserve.layers.linear import Linear
from jaxserve.models.llama import HFWeight, LlamaForCausalLM


class Qwen3ForSequenceClassification(LlamaForCausalLM):
    """Qwen3's decoder (q/k norms: ModelConfig.qk_norm) + `score`, a bias-free Linear
    [hidden, num_labels]."""

    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        super().__init__(config, kv_replicas=kv_replicas, rngs=rngs)
        labels = num_labels(config.hf_config)
        self.score = Linear(config.hidden_size, labels, dtype=config.dtype, rngs=rngs)

    @property
    def classifier_head(self) -> np.ndarray:
        """The score head as the pooler applies it on the host: f32[hidden, num_labels]."""
        return np.asarray(self.score.kernel[...], np.float32)

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        if str(path[0]) == "score":  # HF's [num_labels, hidden] -> [hidden, num_labels]
            return HFWeight(("score.weight",), np.transpose)
        return LlamaForCausalLM.hf_weight(config, path, kv_replicas)
