"""What a model family declares it supports (vLLM's `SupportsMultiModal`, ...): the runner
and the engine ask these, never `hasattr`, whether a model takes a feature."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A model whose placeholder tokens take an image encoder's outputs (models/vlm.py)."""

    def encode(self, **inputs: Any) -> Any:
        """One padded image's inputs -> [tokens, D] text-space embeddings."""
        ...

    @classmethod
    def encoder_buckets(cls, mm_config: dict, max_tokens: int) -> dict:
        """The image shapes compiled at start-up: name -> (tokens, example inputs)."""
        ...

    @classmethod
    def encoder_inputs(cls, mm_config: dict, data: dict, buckets: dict) -> tuple:
        """One image's processed arrays -> (its bucket, the padded inputs)."""
        ...


def supports_multimodal(model: Any) -> bool:
    return isinstance(model, SupportsMultiModal)


def supports_eagle(model_cls: type) -> bool:
    """Whether EAGLE and EAGLE-3 heads draft for this family (its `eagle_target`: the Llama
    forward's final hidden states and aux_layers' inputs; Llama, Qwen2/3, Mistral, Mixtral,
    Qwen3-MoE, GLM-4.5, DeepSeek-V2/V3, gpt-oss)."""
    return bool(getattr(model_cls, "eagle_target", False))
