"""PoolingParams: what a pooling request (LLM.embed, /v1/embeddings) asks of its vector."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PoolingParams:
    """normalize: L2-normalise the vector (None: the model's PoolerConfig says); dimensions:
    keep the first this many (Matryoshka embeddings), renormalised when normalising."""

    dimensions: int | None = None
    normalize: bool | None = None

    def verify(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise ValueError(
                f"dimensions={self.dimensions} must be between 1 and the model's {hidden_size}"
            )

    def apply(self, pooled: np.ndarray, default_normalize: bool) -> list[float]:
        """The engine's pooled f32[D] -> the embedding the user gets."""
        v = np.asarray(pooled, np.float32)[: self.dimensions]
        normalize = default_normalize if self.normalize is None else self.normalize
        if normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.tolist()
