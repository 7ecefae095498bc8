"""The encoder cache's bookkeeping (vLLM V1's EncoderCacheManager), on the scheduler's side.

An image's encoder output (one row per placeholder token) lives in rows of one device buffer
[C, D] (worker/encoder_runner.py) from the step that computes it until every request that
needs it has run its placeholder tokens; then it stays as long as its rows are not needed
(the least recently used goes first), so the same image in a later request is not encoded
again. Each step, `plan` decides which images a request's next tokens need computed, within
the step's encoder budget (max_num_batched_tokens rows, as vLLM's max_num_encoder_input_tokens)
and the cache's free rows, and cuts the request's tokens before an image that cannot be
computed; for a model whose images attend bidirectionally (Gemma 3) an image is never split
across steps.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxserve.core.request import Request


class EncoderCacheManager:
    def __init__(self, num_rows: int, budget: int, *, bidirectional: bool = False):
        """num_rows: the device buffer's rows (C); budget: encoder rows computed per step;
        bidirectional: an image's tokens must run in one step."""
        self.num_rows = num_rows
        self.budget = budget
        self.bidirectional = bidirectional
        self.free_rows = collections.deque(range(num_rows))
        self.cached: dict[str, np.ndarray] = {}  # identifier -> its rows (i32[length])
        self.users: dict[str, set[str]] = {}  # identifier -> requests that still need it
        self.unused: collections.OrderedDict[str, None] = collections.OrderedDict()  # LRU
        self.step_budget = budget
        self.step_inputs: dict[str, list[int]] = {}  # this step's encoder work per request
        self.step_new: set[str] = set()  # identifiers allocated this step (not computed yet)

    def begin_step(self) -> None:
        self.step_budget = self.budget
        self.step_inputs, self.step_new = {}, set()

    def end_step(self) -> dict[str, list[int]]:
        """The step's encoder work (request id -> feature indices), once its plan is made:
        from here on its images count as computed."""
        inputs, self.step_inputs, self.step_new = self.step_inputs, {}, set()
        return inputs

    def plan(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """The request's tokens start .. start + num_new - 1 -> (how many of them may run
        this step, the indices of its images to compute first). Tokens are cut before the
        first image that does not fit the step's budget or the cache (or, bidirectional,
        whose tokens would not all run)."""
        end = start + num_new
        to_compute: list[int] = []
        rows_needed = 0
        for i, f in enumerate(request.mm_features):
            if f.offset >= end:
                break
            if f.end <= start:
                continue
            if self.bidirectional and f.end > end:  # it would be split: stop before it
                return max(f.offset - start, 0), to_compute
            if f.identifier in self.cached or any(
                request.mm_features[j].identifier == f.identifier for j in to_compute
            ):
                continue
            rows_needed += f.length
            if rows_needed > self.step_budget or not self._fits(rows_needed):
                return max(f.offset - start, 0), to_compute
            to_compute.append(i)
        return num_new, to_compute

    def commit(self, request: Request, start: int, num_new: int, to_compute: list[int]) -> None:
        """Hold the images the request's scheduled tokens read: allocate (and schedule) those
        to compute, mark the cached ones used."""
        for i in to_compute:
            f = request.mm_features[i]
            if f.identifier in self.cached:  # another request of this step computes it
                continue
            self._make_room(f.length)
            self.cached[f.identifier] = np.array(
                [self.free_rows.popleft() for _ in range(f.length)], np.int32
            )
            self.step_new.add(f.identifier)
            self.step_budget -= f.length
            self.step_inputs.setdefault(request.request_id, []).append(i)
        for f in self.overlapping(request, start, num_new):
            self.users.setdefault(f.identifier, set()).add(request.request_id)
            self.unused.pop(f.identifier, None)

    @staticmethod
    def overlapping(request: Request, start: int, num_new: int) -> list:
        """The request's images with placeholder tokens among start .. start + num_new - 1."""
        end = start + num_new
        return [f for f in request.mm_features if f.offset < end and f.end > start]

    def done_with(self, request: Request, num_computed: int) -> None:
        """The request has run its tokens before num_computed: let go of the images before
        that (they stay cached, unused, until their rows are needed)."""
        for f in request.mm_features:
            if f.end <= num_computed:
                self._drop_user(f.identifier, request.request_id)

    def release(self, request: Request) -> None:
        """A finished or preempted request needs none of its images any more; an image
        allocated this step for it alone is dropped with its work."""
        for f in request.mm_features:
            self._drop_user(f.identifier, request.request_id)
        for i in self.step_inputs.pop(request.request_id, []):
            ident = request.mm_features[i].identifier
            if ident in self.step_new and not self.users.get(ident):
                self.step_new.discard(ident)
                self.unused.pop(ident, None)
                self.free_rows.extend(self.cached.pop(ident).tolist())
                self.step_budget += request.mm_features[i].length

    def _drop_user(self, ident: str, req_id: str) -> None:
        users = self.users.get(ident)
        if users is None or req_id not in users:
            return
        users.discard(req_id)
        if not users:
            del self.users[ident]
            if ident in self.cached:
                self.unused[ident] = None

    def _fits(self, rows: int) -> bool:
        evictable = sum(len(self.cached[i]) for i in self.unused)
        return rows <= len(self.free_rows) + evictable

    def _make_room(self, rows: int) -> None:
        while len(self.free_rows) < rows:
            ident, _ = self.unused.popitem(last=False)
            self.free_rows.extend(self.cached.pop(ident).tolist())

    def rows(self, ident: str) -> np.ndarray:
        return self.cached[ident]
