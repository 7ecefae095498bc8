"""The multimodal feature a request carries from the frontend to the engine core."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a prompt, processed.

    Its encoder output has `length` rows, which replace the embeddings of prompt tokens
    offset .. offset + length - 1 (its placeholder tokens). `identifier` is the content hash
    (sha256 of the processed arrays): two requests with the same image share prefix-cache
    blocks and encoder outputs, different images never do.
    """

    modality: str  # "image"
    identifier: str
    offset: int
    length: int
    data: dict[str, np.ndarray]  # the HF processor's arrays for this image (pixel_values, ...)

    @property
    def end(self) -> int:
        return self.offset + self.length


def prompt_embeds_feature(embeds: Any, hidden_size: int) -> MultiModalFeature:
    """A prompt given as embeddings [P, hidden_size] (numpy, jax or torch; any float dtype)
    as the feature over its P placeholder tokens (worker/prompt_embeds.py); ValueError naming
    what is wrong with it. Its identifier (the prefix-cache key) is the content hash."""
    if hasattr(embeds, "detach"):  # a torch tensor (bfloat16 too)
        embeds = embeds.detach().float().cpu().numpy()
    try:
        array = np.asarray(embeds, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"prompt_embeds must be an array of floats: {e}") from None
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds must be [positions, {hidden_size}] (the model's hidden size), "
            f"got shape {list(array.shape)}"
        )
    if not np.isfinite(array).all():
        raise ValueError("prompt_embeds must be finite (no NaN or inf)")
    array = np.ascontiguousarray(array)
    digest = hashlib.sha256(repr(array.shape).encode() + array.tobytes()).hexdigest()
    return MultiModalFeature("embeds", f"embeds-{digest}", 0, len(array), {"embeds": array})
