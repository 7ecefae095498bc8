"""When to stop drafting a request for a while: drafts cost a forward token and a sampling
row each, which pays at batch 1 (the step reads the weights anyway) but not in a large batch
of requests whose drafts are never right (random text)."""

from __future__ import annotations

MAX_WAIT = 16  # steps


class DraftBackoff:
    """Per request: after m drafts in a row with nothing accepted, skip the next
    min(2^m - 1, MAX_WAIT) chances to draft; any accepted draft token resets it. Output never
    depends on it (drafts only decide how many tokens a step may keep)."""

    def __init__(self):
        self._misses: dict[str, int] = {}
        self._wait: dict[str, int] = {}

    def observe(self, req_id: str, num_accepted: int) -> None:
        if num_accepted:
            self._misses.pop(req_id, None)
            return
        misses = self._misses[req_id] = self._misses.get(req_id, 0) + 1
        self._wait[req_id] = min(2**misses - 1, MAX_WAIT)

    def should_draft(self, req_id: str) -> bool:
        wait = self._wait.get(req_id, 0)
        if wait:
            self._wait[req_id] = wait - 1
        return not wait

    def forget(self, req_id: str) -> None:
        self._misses.pop(req_id, None)
        self._wait.pop(req_id, None)
