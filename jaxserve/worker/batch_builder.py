"""Lifecycle step 6, building the batch: a `SchedulerOutput` and the persistent `InputBatch`
become one step's forward and sampling inputs, padded to the smallest ready buckets, with
numpy alone (no device work, no loop over the rows' SamplingParams).

The flat batch: request i runs tokens qsl[i] .. qsl[i + 1] - 1 at positions start[i] ..; its
KV goes to `slot_mapping` (block * block_size + offset, a row per KV-cache group). Sampling
rows: one per request at its last token, and with speculative decoding one more per draft
token before it (request i's rows are first_row[i] .. first_row[i] + num_rows[i] - 1, at its
last num_rows[i] tokens).
The tokens of a request scheduled while its previous step is in flight are not known here:
they are placeholders the forward reads from the step state on the device
(worker/step_state.py); the input batch takes each step's tokens at its fetch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.config.kv_groups import KVCacheLayout
from jaxserve.core.scheduler_output import PromptLogprobs, SchedulerOutput
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.structured_output import bitmask_words
from jaxserve.worker.buckets import BucketTable, bucket
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_state import NO_DRAFT, SettleInputs
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
        kv_layout: KVCacheLayout | None = None,
    ):
        """decode_only_forwards: a step whose every request runs one token takes the
        decode-only forward (`AttentionMetadata.decode_only`); kv_layout: the KV-cache
        groups when there are several (CacheConfig.grouped_layout), else None. A feature's fields
        of the forward's inputs are its own (worker/step_feature.py)."""
        self.buckets = buckets
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.num_spec_tokens = num_spec_tokens
        self.decode_only_forwards = decode_only_forwards
        self.kv_layout = kv_layout
        self.num_groups = kv_layout.num_groups if kv_layout else 1
        self.bitmask_words = bitmask_words(vocab_size)
        self._free_bitmasks: dict[int, np.ndarray] = {}

    def build(
        self, so: SchedulerOutput, ib: InputBatch, token_buckets: Sequence[int], step: int
    ) -> StepBatch | None:
        """The step's inputs (None when nothing is scheduled), after `ib.update(so)`.
        token_buckets: the token buckets ready to run (all once start-up compiled them);
        step: the step counter (folded into the sampler's PRNG key). Writes the scheduled
        drafts the host knows into `ib` (after its known tokens)."""
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return None
        rows = np.array([ib.req_id_to_row[r] for r in req_ids], np.int32)
        n_sched = np.fromiter(so.num_scheduled_tokens.values(), np.int32, len(req_ids))
        num_reqs, num_tokens = len(req_ids), int(n_sched.sum())
        start = ib.num_computed_tokens[rows]
        # A request scheduled before its previous step was fetched runs tokens the host does
        # not know yet: placeholders of its step-state columns (worker/step_state.py).
        ahead = start >= ib.num_tokens[rows]
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
        n_rows = np.array([1 + len(d) for d in drafts], np.int32)
        for row, d, a in zip(rows, drafts, ahead, strict=True):
            if d and not a:  # the drafts are the inputs after the last known token
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
        ids = ib.token_ids[row_of_token, np.minimum(pos, self.max_model_len - 1)]
        placeholder = -1 - (pos - np.repeat(start, n_sched))  # the step's j-th: column j
        ids = _padded(np.where(np.repeat(ahead, n_sched), placeholder, ids), t, 0)
        blocks = ib.block_table[:, row_of_token, pos // self.block_size]  # [G, num_tokens]
        slots = np.full((self.num_groups, t), -1, np.int32)
        slots[:, :num_tokens] = blocks * self.block_size + pos % self.block_size
        block_tables = np.zeros((self.num_groups, sf, self.max_blocks_per_req), np.int32)
        block_tables[:, :num_reqs] = ib.block_table[:, rows]
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
            layout=self.kv_layout,
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
        # Each row's output position: tokens generated before the one it samples.
        last_pos = start + n_sched - 1
        out_pos = np.repeat(last_pos + 2 - n_rows, n_rows) + row_offset
        out_pos = np.maximum(out_pos - ib.num_prompt_tokens[sample_rows], 0)
        sampling, needed = ib.sampling.metadata(sample_rows, out_pos, s, self.free_bitmask(s))
        # The step reaches the end of the tokens: its sample is kept (the host learns it,
        # and a drafted request's accepted drafts, at fetch(); the next step may read it
        # from the step state before). Penalties count a request's kept token now (appends)
        # unless it drafted: its row's counts are filled again at fetch().
        sampled = np.fromiter((r in so.sampled_req_ids for r in req_ids), bool, num_reqs)
        kept = sampled & (n_rows == 1)
        appends = np.zeros(s, bool)
        appends[first_row[kept]] = True
        prior_drafts = np.full((s, self.num_spec_tokens), -1, np.int32)
        verify = np.full(s, NO_DRAFT, np.int32)
        for i, d in enumerate(drafts):  # row first + j counts the first j drafts
            if not d:
                continue
            first = first_row[i]
            verify[first : first + len(d)] = (
                -2 - np.arange(len(d), dtype=np.int32) if ahead[i] else d
            )
            if not ahead[i]:
                for j in range(1, len(d) + 1):
                    prior_drafts[first + j, :j] = d[:j]
        q, n_all = self.buckets.seqs[-1], len(ib.num_tokens)
        settle = SettleInputs(
            verify,
            _padded(rows, q, n_all),
            _padded(first_row, q, 0),
            _padded(n_rows - 1, q, 0),
            np.pad(sampled, (0, q - num_reqs)),
            np.pad(ahead, (0, q - num_reqs)),
            _padded(last_pos, q, 0),
        )
        sample = SampleInputs(
            sampling,
            _padded(sample_rows, s, 0),
            appends,
            np.bool_(ib.sampling.logprobs[rows].any()),
            np.int32(step),
            prior_drafts,
            settle,
        )
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
            ahead,
            targets,
            wants_prompt_lp,
        )

    def padding_forward(self, t: int, decode_only: bool = False) -> ForwardInputs:
        """Forward inputs of token bucket t that run nothing (no sequence, no KV write)."""
        s = self.buckets.forward_seqs(t)
        ids = np.zeros(t, np.int32)
        g = self.num_groups
        attn = AttentionMetadata(
            slot_mapping=np.full((g, t), -1, np.int32),
            block_tables=np.zeros((g, s, self.max_blocks_per_req), np.int32),
            kv_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            num_seqs=np.zeros(1, np.int32),
            decode_only=decode_only,
            layout=self.kv_layout,
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
            self.padding_settle(s, sampling_rows),
        )

    def padding_settle(self, s: int, sampling_rows) -> SettleInputs:
        """Settle inputs of s rows and no request."""
        q, n = self.buckets.seqs[-1], len(sampling_rows.min_tokens)
        none = np.zeros(q, np.int32)
        return SettleInputs(
            np.full(s, NO_DRAFT, np.int32),
            np.full(q, n, np.int32),
            none,
            none,
            np.zeros(q, bool),
            np.zeros(q, bool),
            none,
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
