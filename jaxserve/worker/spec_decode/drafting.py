"""The runner's side of speculative decoding after a step is fetched: which drafts each
request keeps, and the next drafts.

Every draft position is a sampling row, sampled exactly as it would be without speculation;
the draft at position j is accepted while it equals row j's sample, and the first row that
disagrees (or the row after the last draft) gives the request's next token. For a draft that
is a single token (ngram, greedy draft models), this is the rejection sampler itself: accepted
with probability p_j(draft), and otherwise a sample of p_j conditioned on not being the
draft (p_j with the draft removed, renormalised); a seeded request's rows even draw the same
uniforms as without speculation.
"""

from __future__ import annotations

import numpy as np

from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.spec_decode.backoff import DraftBackoff
from jaxserve.worker.spec_decode.proposer import Proposer
from jaxserve.worker.step_types import StepBatch


class Drafting:
    def __init__(self, proposer: Proposer, max_model_len: int):
        self.proposer = proposer
        self.backoff = DraftBackoff()
        self.max_model_len = max_model_len

    def forget(self, req_id: str) -> None:
        self.backoff.forget(req_id)

    def accept(
        self, batch: StepBatch, row_ids: np.ndarray, accepted: np.ndarray, ib: InputBatch
    ) -> tuple[np.ndarray, dict[str, list[int]], list[int]]:
        """row_ids: i32[S], every sampling row's sample; accepted: i32[>= num_reqs], each
        request's accepted drafts (the step's settle, worker/step_state.py). Returns each
        request's row whose sample it keeps (i32[num_reqs]), each drafted request's
        accepted drafts (its rows' samples before that one), and the input-batch rows of
        penalised requests that took tokens the step did not count (their penalty state
        must be filled again)."""
        n = len(batch.req_ids)
        accepted = np.where(batch.sampled, accepted[:n], 0)
        final_row = batch.first_row + accepted
        drafted, refill = {}, []
        for i in np.flatnonzero(batch.num_rows > 1):
            req_id, first, a = batch.req_ids[i], batch.first_row[i], int(accepted[i])
            drafted[req_id] = row_ids[first : first + a].tolist()
            self.backoff.observe(req_id, a)
            row = batch.rows[i]
            if ib.holds(req_id, row) and ib.sampling.penalised[row]:
                refill.append(int(row))
        return final_row, drafted, refill

    def propose(
        self, batch: StepBatch, final_row: np.ndarray, ib: InputBatch, drafts: np.ndarray | None
    ) -> dict[str, list[int]]:
        """The next drafts of the step's requests that sampled a token and may be drafted
        (as many as fit before max_model_len with the token sampled after them); final_row:
        each request's sampling row whose sample it kept (after `ib.append_sampled`);
        drafts: i32[>= num_reqs, k], a device proposer's (None: the host proposes now)."""
        if not self.proposer.num_speculative_tokens:
            return {}
        chosen = [
            i
            for i in np.flatnonzero(batch.sampled)
            if ib.holds(batch.req_ids[i], batch.rows[i])
            and self.backoff.should_draft(batch.req_ids[i])
        ]
        rows = batch.rows[chosen]
        if drafts is None:
            proposed = self.proposer.propose_rows(ib, rows, final_row[chosen])
        else:
            proposed = drafts[chosen].tolist()
        out = {}
        for i, row, d in zip(chosen, rows, proposed, strict=True):
            d = d[: self.max_model_len - int(ib.num_tokens[row]) - 1]
            if d:
                out[batch.req_ids[i]] = d
        return out
