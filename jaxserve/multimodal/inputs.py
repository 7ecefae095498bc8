"""The multimodal feature a request carries from the frontend to the engine core."""

from __future__ import annotations

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
