"""Prompt-lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of
the sequence's longest matching suffix."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxserve.worker.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    """Drafts up to k tokens from a request's own tokens, on the host (no device work).

    For n from max_n down to min_n: if the last n tokens occurred earlier, the draft is what
    followed their latest earlier occurrence (at most k tokens, fewer near the end)."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.num_speculative_tokens = k

    def propose_rows(self, ib, rows: np.ndarray, sample_rows=None) -> list[list[int]]:
        """Drafts for the InputBatch's `rows`, each from its own tokens."""
        return [self.propose_tokens(ib.token_ids[r, : ib.num_tokens[r]]) for r in rows]

    def propose_tokens(self, token_ids: np.ndarray, k: int | None = None) -> list[int]:
        """token_ids: i32[L], a request's prompt and output so far -> at most k draft ids."""
        k = self.k if k is None else min(k, self.k)
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows[i] = token_ids[i : i + n] for i < length - n (an earlier occurrence)
            windows = sliding_window_view(token_ids[: length - 1], n)
            hits = np.flatnonzero((windows == token_ids[length - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return token_ids[start : start + k].tolist()
        return []
