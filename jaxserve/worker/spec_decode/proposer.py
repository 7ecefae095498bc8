"""The proposer interface: what the model runner asks of a drafting method, with no-op
defaults, so `Proposer()` itself is the runner's proposer without speculative decoding.

A proposer drafts each request's next tokens either on the devices, right after a step's
sampling and before the step is fetched (`propose`: a draft model, an EAGLE or MTP head; the
next step may then be dispatched before the fetch, async scheduling, and read the drafts
from the step state), or on the host from the input batch after the fetch (`propose_rows`:
ngram). One that keeps a KV cache of its own (in the target's block layout, the same block
ids) sizes and allocates it beside the target's, adds its executables to the runner's
start-up (`lowerings`, then `set_executables`) and mirrors every target forward (`mirror`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from jaxserve.worker.input_batch import InputBatch
    from jaxserve.worker.step_state import Settled
    from jaxserve.worker.step_types import ForwardInputs, StepBatch


class Proposer:
    num_speculative_tokens = 0  # k
    aux_layers: tuple[int, ...] = ()  # target layers whose inputs every forward also returns

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of this proposer's KV cache per block id (0: it keeps none)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def lowerings(
        self,
        padding_forwards: dict[tuple[int, bool], ForwardInputs],
        seq_buckets,
        max_blocks,
        state,
        settled,
    ) -> dict[tuple, Any]:
        """Its executables, name -> () -> jax.stages.Lowered; padding_forwards: the target
        forward's padding inputs per (token bucket, decode_only); state, settled: the shapes
        of the step state and of a sampling's outcome (worker/step_state.py)."""
        return {}

    def set_executables(self, executables) -> None:
        """The runner's ExecutableRegistry, once compile_all has them."""

    def mirror(
        self, batch: StepBatch, features: jax.Array, feature_rows: jax.Array, state: jax.Array
    ) -> None:
        """Follow a dispatched target forward (features: its [T, F] per-token and [R, F]
        per-sampling-row hidden states or EAGLE-3 features; state: the step state it read,
        worker/step_state.py)."""

    def propose(
        self, state: jax.Array, batch: StepBatch, settled: Settled, ib: InputBatch
    ) -> tuple[jax.Array, jax.Array | None]:
        """Draft on the devices after a dispatched sampling (settled: its outcome) for each
        request that sampled: (the state with the drafts in its columns, drafts i32[Q, k]
        for the fetch, in the step's request order); (state, None) for a host proposer."""
        return state, None

    def propose_rows(
        self, ib: InputBatch, rows: np.ndarray, sample_rows: np.ndarray
    ) -> list[list[int]]:
        """A host proposer's drafts for the input batch's `rows`, each after its latest token;
        sample_rows: the sampling row of the step just fetched that gave each its latest
        token."""
        return [[] for _ in rows]
