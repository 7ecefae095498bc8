"""The proposer interface: what the model runner asks of a drafting method, with no-op
defaults, so `Proposer()` itself is the runner's proposer without speculative decoding.

A proposer drafts each request's next tokens from the input batch after a step's fetch
(`propose_rows`). One that keeps a KV cache of its own (a draft model, an EAGLE head: in the
target's block layout, the same block ids) sizes and allocates it beside the target's, adds
its executables to the runner's start-up (`lowerings`, then `set_executables`) and mirrors
every target forward (`mirror`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from jaxserve.worker.input_batch import InputBatch
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
        self, padding_forwards: dict[tuple[int, bool], ForwardInputs], seq_buckets, max_blocks
    ) -> dict[tuple, Any]:
        """Its executables, name -> () -> jax.stages.Lowered; padding_forwards: the target
        forward's padding inputs per (token bucket, decode_only)."""
        return {}

    def set_executables(self, executables) -> None:
        """The runner's ExecutableRegistry, once compile_all has them."""

    def mirror(self, batch: StepBatch, features: jax.Array, feature_rows: jax.Array) -> None:
        """Follow a dispatched target forward (features: its [T, F] per-token and [R, F]
        per-sampling-row hidden states or EAGLE-3 features)."""

    def propose_rows(
        self, ib: InputBatch, rows: np.ndarray, sample_rows: np.ndarray
    ) -> list[list[int]]:
        """Drafts for the input batch's `rows`, each after its latest token; sample_rows:
        the sampling row of the step just fetched that gave each its latest token."""
        return [[] for _ in rows]
