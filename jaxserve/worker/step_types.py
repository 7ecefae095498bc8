"""The types a step passes between its parts: what the batch builder makes on the host
(`ForwardInputs`, `SampleInputs`, inside a `StepBatch`), and what a dispatched step keeps
until it is fetched (`PendingStep`).

Shapes: T, the step's token bucket; R = min(T, max_num_seqs) rounded up to a sequence bucket
(the forward's sequence rows); S, the sample bucket (one row per request, plus one per draft
token); k, the draft tokens a request may run (0 without speculative decoding).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxserve.layers.sampler import SamplerVariant, SamplingMetadata
from jaxserve.models.step_inputs import StepInputs
from jaxserve.worker.step_state import SettleInputs

# The forward's host-built inputs: the models' typed step inputs (models/step_inputs.py)
ForwardInputs = StepInputs


class SampleInputs(NamedTuple):
    """The sampling step's host-built inputs: S rows (padded with greedy rows)."""

    sampling: SamplingMetadata  # [S] rows; prompt_mask / output_counts None (from the device)
    rows: np.ndarray  # i32[S]: each sampling row's input-batch row (its penalty state)
    appends: np.ndarray  # bool[S]: the row's sample is kept and counted now (no drafts)
    want_logprobs: np.ndarray  # bool[]: some sequence asked for sampled-token logprobs
    step: np.ndarray  # i32[]: the step counter, folded into the PRNG key
    # i32[S, k]: the drafts before each row's position (-1: none), which penalties count as
    # output (speculative decoding)
    prior_drafts: np.ndarray
    settle: SettleInputs  # acceptance and the step state's update (worker/step_state.py)


class StepBatch(NamedTuple):
    """One scheduled step as the batch builder lays it out (worker/batch_builder.py); the
    per-request arrays are in `req_ids` order."""

    req_ids: list[str]
    rows: np.ndarray  # i32[num_reqs]: each request's input-batch row
    start: np.ndarray  # i32[num_reqs]: first position run this step
    num_scheduled: np.ndarray  # i32[num_reqs]: tokens run this step (drafts included)
    num_tokens: int  # T, the token bucket (real tokens: num_scheduled.sum())
    qsl: np.ndarray  # i32[R + 1]: query start locations in the flat batch
    forward: ForwardInputs
    sample: SampleInputs
    needed: SamplerVariant  # the sampler's passes the rows need (structured: added later)
    drafts: list[list[int]]  # each request's scheduled draft tokens
    first_row: np.ndarray  # i32[num_reqs]: each request's first sampling row
    num_rows: np.ndarray  # i32[num_reqs]: its sampling rows (1 + its drafts)
    sampled: np.ndarray  # bool[num_reqs]: the step samples the request's next token
    ahead: np.ndarray  # bool[num_reqs]: its tokens are placeholders (its last step in flight)
    targets: np.ndarray  # i32[T]: each position's prompt-logprob target (-1: none)
    wants_prompt_lp: np.ndarray  # bool[num_reqs]


class PendingStep(NamedTuple):
    """A dispatched step: its batch, its device outputs and what fetch() brings back."""

    batch: StepBatch
    fetch: dict | None  # device arrays to bring back; None until the sampling is dispatched
    last_hidden: jax.Array | None = None  # [max_sample_rows, D], until sampled
    hidden: jax.Array | None = None  # [T, D], until sampled
    # Each feature's after_forward value by its name (worker/step_feature.py): device arrays
    # until the step is fetched
    features: dict = {}  # noqa: RUF012 (never mutated: each step passes its own)
