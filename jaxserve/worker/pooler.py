"""A pooling runner's (`runner="pooling"`, embeddings) share of a step: every step also pools
its prompt tokens' final hidden states on the device (`pool`: per request the
sum, the first and the last), and the host accumulates them over a prompt's chunks until the
step its prompt ends, which gives its vector: the last token's, the mean over the prompt, or
the first token's (PoolerConfig.pooling_type: LAST, MEAN, CLS). A classifier's
(models/seq_cls.py) vector is then its score head's logits over that: f32[num_labels]."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_feature import LoweringInputs, StepFeature
from jaxserve.worker.step_types import StepBatch


def pool(hidden, seq_of_token, first, last, *, num_seqs: int):
    """hidden [T, D]; seq_of_token i32[T] (num_seqs: padding); first, last i32[num_seqs]: each
    sequence's first and last token in the step -> f32 (sum over its tokens, first token's,
    last token's hidden state), each [num_seqs, D]."""
    h = hidden.astype(jnp.float32)
    sums = jax.ops.segment_sum(h, seq_of_token, num_segments=num_seqs + 1)[:num_seqs]
    return sums, h[first], h[last]


class Pooler(StepFeature):
    name = "pooled"

    def __init__(
        self, pooling_type: str, max_num_seqs: int, head: np.ndarray | None = None, rep=None
    ):
        """head: a classifier's f32[D, num_labels], applied to each pooled vector (in float32
        on the host: [D] x [D, L] per finished prompt, far less than its step); rep: the
        replicated sharding of its outputs."""
        self.pooling_type = pooling_type
        self.max_num_seqs = max_num_seqs
        self.head = head
        self._acc: dict[str, list] = {}  # req_id -> [sum f32[D], first f32[D]]
        self._pool = jax.jit(functools.partial(pool, num_seqs=max_num_seqs), out_shardings=rep)

    def lowerings(self, inputs: LoweringInputs) -> dict[tuple, Callable[[], Any]]:
        """("pool", t) for every token bucket."""
        idx = np.zeros(self.max_num_seqs, np.int32)
        return {
            ("pool", t): functools.partial(
                self._pool.lower, inputs.hidden(t), np.zeros(t, np.int32), idx, idx
            )
            for t in inputs.token_buckets
        }

    def after_forward(
        self, so: SchedulerOutput, batch: StepBatch, hidden: jax.Array, kv_caches, executables
    ) -> Any:
        """Each request's sum, first and last hidden state of the step, on the device."""
        return executables["pool", batch.num_tokens](hidden, *self.inputs(batch))

    def finish(
        self, batch: StepBatch, value: Any, ib: InputBatch, result: ModelRunnerOutput
    ) -> None:
        result.pooled = self.outputs(batch, ib.num_prompt_tokens[batch.rows], *value)

    def inputs(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seq_of_token i32[T], first i32[max_num_seqs], last i32[max_num_seqs]): each token's
        request (max_num_seqs: padding, dropped), each request's first and last token."""
        num_reqs = len(batch.req_ids)
        seq_of_token = np.full(batch.num_tokens, self.max_num_seqs, np.int32)
        n = int(batch.qsl[num_reqs])
        seq_of_token[:n] = np.repeat(np.arange(num_reqs, dtype=np.int32), batch.num_scheduled)
        first = np.zeros(self.max_num_seqs, np.int32)
        first[:num_reqs] = batch.qsl[:num_reqs]
        last = batch.forward.logits_indices[: self.max_num_seqs]  # one row each: no drafts
        return seq_of_token, first, last

    def forget(self, req_id: str) -> None:
        self._acc.pop(req_id, None)

    def outputs(
        self, batch: StepBatch, num_prompt_tokens: np.ndarray, sums, firsts, lasts
    ) -> dict[str, np.ndarray]:
        """Accumulate a step's pooled hidden states ([max_num_seqs, D] each, in the step's
        request order) and return the vector of each request whose prompt ended: its last
        token's, the mean over its prompt, or its first token's (num_prompt_tokens:
        i32[num_reqs], each request's prompt length)."""
        out = {}
        for i, req_id in enumerate(batch.req_ids):
            if batch.start[i] == 0:  # the prompt's first chunk (again, after a preemption)
                self._acc[req_id] = [np.zeros_like(sums[i]), firsts[i]]
            acc = self._acc[req_id]
            acc[0] = acc[0] + sums[i]
            if batch.sampled[i]:  # the prompt ended in this step
                del self._acc[req_id]
                if self.pooling_type == "LAST":
                    out[req_id] = lasts[i]
                elif self.pooling_type == "MEAN":
                    out[req_id] = acc[0] / num_prompt_tokens[i]
                else:
                    out[req_id] = acc[1]
                if self.head is not None:
                    out[req_id] = np.asarray(out[req_id], np.float32) @ self.head
        return out
