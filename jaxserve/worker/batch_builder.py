"""Lifecycle step 6, building the batch: a `SchedulerOutput` and the persistent `InputBatch`
become one step's forward and sampling inputs, padded to the smallest ready buckets, with
numpy alone (no device work, no loop over the rows' SamplingParams).

The flat batch: request i runs tokens qsl[i] .. qsl[i + 1] - 1 at positions start[i] ..; its
KV goes to `slot_mapping` (block * block_size + offset). Sampling rows: one per request at
its last token, and with speculative decoding one more per draft token before it (request i's
rows are first_row[i] .. first_row[i] + num_rows[i] - 1, at its last num_rows[i] tokens).
A token sampled by a step still in flight is -1 in the input batch (the forward reads it from
the device); the tokens this step samples and keeps are appended as -1 the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.core.scheduler_output import PromptLogprobs, SchedulerOutput
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.structured_output import bitmask_words
from jaxserve.worker.buckets import BucketTable, bucket
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_types import ForwardInputs, SampleInputs, StepBatch


class BatchBuilder:
    def __init__(
        self,
        buckets: BucketTable,
        *,
        block_size: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        num_spec_tokens: int = 0,
        decode_only_forwards: bool = False,
    ):
        """decode_only_forwards: a step whose every request runs one token takes the
        decode-only forward (`AttentionMetadata.decode_only`). A feature's fields of the
        forward's inputs are its own (worker/step_feature.py)."""
        self.buckets = buckets
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.num_spec_tokens = num_spec_tokens
        self.decode_only_forwards = decode_only_forwards
        self.bitmask_words = bitmask_words(vocab_size)
        self._free_bitmasks: dict[int, np.ndarray] = {}

    def build(
        self, so: SchedulerOutput, ib: InputBatch, token_buckets: Sequence[int], step: int
    ) -> StepBatch | None:
        """The step's inputs (None when nothing is scheduled), after `ib.update(so)`.
        token_buckets: the token buckets ready to run (all once start-up compiled them);
        step: the step counter (folded into the sampler's PRNG key). Writes the scheduled
        drafts and this step's placeholders into `ib`."""
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return None
        rows = np.array([ib.req_id_to_row[r] for r in req_ids], np.int32)
        n_sched = np.fromiter(so.num_scheduled_tokens.values(), np.int32, len(req_ids))
        num_reqs, num_tokens = len(req_ids), int(n_sched.sum())
        start = ib.num_computed_tokens[rows]
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
        n_rows = np.array([1 + len(d) for d in drafts], np.int32)
        for row, d in zip(rows, drafts, strict=True):
            if d:  # the drafts are the inputs after the last known token
                ib.token_ids[row, ib.num_tokens[row] : ib.num_tokens[row] + len(d)] = d
        first_row = (np.cumsum(n_rows) - n_rows).astype(np.int32)
        num_rows = int(n_rows.sum())
        t = bucket(token_buckets, num_tokens)
        sf = self.buckets.forward_seqs(t)
        s = self.buckets.sample(num_rows)

        qsl = np.zeros(sf + 1, np.int32)
        qsl[1 : num_reqs + 1] = np.cumsum(n_sched)
        qsl[num_reqs + 1 :] = num_tokens
        row_of_token = np.repeat(rows, n_sched)  # [num_tokens]
        pos = np.arange(num_tokens, dtype=np.int32) - np.repeat(qsl[:num_reqs], n_sched)
        pos += np.repeat(start, n_sched)
        ids = _padded(ib.token_ids[row_of_token, pos], t, 0)  # -1: a token still being sampled
        blocks = ib.block_table[row_of_token, pos // self.block_size]
        slots = _padded(blocks * self.block_size + pos % self.block_size, t, -1)
        block_tables = np.zeros((sf, self.max_blocks_per_req), np.int32)
        block_tables[:num_reqs] = ib.block_table[rows]
        # Each request's last n_rows tokens: the positions whose next token is sampled.
        row_offset = np.arange(num_rows, dtype=np.int32) - np.repeat(first_row, n_rows)
        logits_indices = _padded(
            np.repeat(qsl[1 : num_reqs + 1] - n_rows, n_rows) + row_offset,
            self.buckets.max_sample_rows,
            0,
        )
        # Every request has one new token (drafts make more): the decode-only forward.
        decode_only = self.decode_only_forwards and num_tokens == num_reqs
        attn = AttentionMetadata(
            slots,
            block_tables,
            _padded(start + n_sched, sf, 0),
            qsl,
            np.array([num_reqs], np.int32),
            decode_only,
        )
        forward = ForwardInputs(
            ids,
            _padded(pos, t, 0),
            _padded(row_of_token, t, 0),
            attn,
            logits_indices,
        )

        # Prompt logprobs: the token at pos + 1 is the target of position pos, while in the prompt.
        targets = np.full(t, -1, np.int32)
        wants_prompt_lp = ib.sampling.prompt_logprobs[rows]
        if wants_prompt_lp.any():
            in_prompt = np.repeat(wants_prompt_lp, n_sched) & (
                pos + 1 < ib.num_prompt_tokens[row_of_token]
            )
            next_ids = ib.token_ids[row_of_token, np.minimum(pos + 1, self.max_model_len - 1)]
            targets[:num_tokens] = np.where(in_prompt, next_ids, -1)

        sample_rows = np.repeat(rows, n_rows)
        out_pos = ib.num_tokens[sample_rows] - ib.num_prompt_tokens[sample_rows] + row_offset
        sampling, needed = ib.sampling.metadata(sample_rows, out_pos, s, self.free_bitmask(s))
        # The step reaches the end of the tokens: its sample is kept (a drafted request's
        # kept token is known only after fetch(): the host writes it then).
        sampled = np.fromiter((r in so.sampled_req_ids for r in req_ids), bool, num_reqs)
        kept = sampled & (n_rows == 1)
        appends = np.zeros(s, bool)
        appends[first_row[kept]] = True
        prior_drafts = np.full((s, self.num_spec_tokens), -1, np.int32)
        for i, d in enumerate(drafts):  # row first + j counts the first j drafts
            for j in range(1, len(d) + 1):
                prior_drafts[first_row[i] + j, :j] = d[:j]
        sample = SampleInputs(
            sampling,
            _padded(sample_rows, s, 0),
            appends,
            np.bool_(ib.sampling.logprobs[rows].any()),
            np.int32(step),
            prior_drafts,
        )
        # The kept tokens are placeholders until fetch(): the next step reads them from the
        # device (the runner's last_tokens).
        append_rows = rows[kept]
        append_positions = ib.num_tokens[append_rows].copy()
        ib.token_ids[append_rows, append_positions] = -1
        ib.num_tokens[append_rows] += 1
        return StepBatch(
            req_ids,
            rows,
            start,
            n_sched,
            t,
            qsl,
            forward,
            sample,
            needed,
            drafts,
            first_row,
            n_rows,
            sampled,
            kept,
            append_positions,
            targets,
            wants_prompt_lp,
        )

    def padding_forward(self, t: int, decode_only: bool = False) -> ForwardInputs:
        """Forward inputs of token bucket t that run nothing (no sequence, no KV write)."""
        s = self.buckets.forward_seqs(t)
        ids = np.zeros(t, np.int32)
        attn = AttentionMetadata(
            slot_mapping=np.full(t, -1, np.int32),
            block_tables=np.zeros((s, self.max_blocks_per_req), np.int32),
            kv_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            num_seqs=np.zeros(1, np.int32),
            decode_only=decode_only,
        )
        return ForwardInputs(
            ids,
            ids,
            ids,
            attn,
            np.zeros(self.buckets.max_sample_rows, np.int32),
        )

    def padding_sample(self, s: int, sampling_rows) -> SampleInputs:
        """Sampling inputs of s greedy padding rows (what start-up lowers the sampler with);
        sampling_rows: an InputBatch's `sampling`."""
        sampling, _ = sampling_rows.metadata(
            np.zeros(0, np.int32), np.zeros(0, np.int32), s, self.free_bitmask(s)
        )
        return SampleInputs(
            sampling,
            np.zeros(s, np.int32),
            np.zeros(s, bool),
            np.bool_(False),
            np.int32(0),
            np.full((s, self.num_spec_tokens), -1, np.int32),
        )

    def free_bitmask(self, s: int) -> np.ndarray:
        """i32[s, ceil(V/32)] with every token allowed (a step without constrained rows: the
        variants that ignore the mask never even transfer it)."""
        if s not in self._free_bitmasks:
            self._free_bitmasks[s] = np.full((s, self.bitmask_words), -1, np.int32)
        return self._free_bitmasks[s]


def _padded(values: np.ndarray, n: int, fill: int) -> np.ndarray:
    """i32[n]: values, then fill."""
    out = np.full(n, fill, np.int32)
    out[: len(values)] = values
    return out


def prompt_logprobs_of(batch: StepBatch, lp, lp_ids, ranks) -> dict[str, PromptLogprobs]:
    """Each request's prompt logprobs of the step, from [T, K+1] x2 and [T] over its tokens."""
    out = {}
    qsl, targets = batch.qsl, batch.targets
    for i in np.flatnonzero(batch.wants_prompt_lp):
        lo, hi = qsl[i], qsl[i + 1]
        valid = lo + int(np.sum(targets[lo:hi] >= 0))  # a prefix of the chunk
        if valid > lo:  # prompt positions start[i] + 1 ..
            out[batch.req_ids[i]] = PromptLogprobs(
                int(batch.start[i]) + 1, lp[lo:valid], lp_ids[lo:valid], ranks[lo:valid]
            )
    return out
