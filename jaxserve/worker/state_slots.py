"""A hybrid model's kept linear-attention states on the device (the runner's side of
core/state_cache.py): the state arrays (conv and recurrent, one of each per linear layer)
have max_num_seqs input-batch rows and then `num_slots` slots, and one compiled program copies
rows into slots and slots into rows.

A step's saves (a request's row into a slot, once the step's forward has left the state at
the request's boundary) are copied before the next step's forward, ahead of that step's
restores (a slot into a newly admitted request's row): the row still holds the state then,
and a slot saved in one step is never restored before the next (the scheduler finds it only
from then on). Copies are padded to max_num_seqs pairs with an index past the arrays, which
the scatter drops."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_feature import LoweringInputs, StepFeature


def copy_rows(kv_caches: tuple, saves: jax.Array, restores: jax.Array) -> tuple:
    """kv_caches: (K, V, conv per layer, rec per layer); saves, restores: i32[2, M] (source
    rows, destination rows) copied in that order. Returns the caches."""
    k, v, conv, rec = kv_caches

    def copy(x: jax.Array) -> jax.Array:
        for src, dst in (saves, restores):
            x = x.at[dst].set(x[jnp.minimum(src, x.shape[0] - 1)], mode="drop")
        return x

    return k, v, tuple(map(copy, conv)), tuple(map(copy, rec))


class StateSlots(StepFeature):
    """The state copies of each step (SchedulerOutput.state_saves / state_restores)."""

    def __init__(self, num_rows: int, num_slots: int, kv_sharding: Any):
        """num_rows: the input-batch rows (max_num_seqs): slot s is state row num_rows + s."""
        self.num_rows, self.num_slots = num_rows, num_slots
        self.pending_saves: list[tuple[int, int]] = []  # (row, state row) after the last step
        self.saves: list[tuple[int, int]] = []  # this step's, copied before the next forward
        self.restores: list[tuple[int, int]] = []  # (state row, row) before this forward
        self._copy = jax.jit(copy_rows, donate_argnums=(0,), out_shardings=kv_sharding)

    def cache_key(self) -> dict[str, str]:
        return {"state_slots": str(self.num_slots)}

    def lowerings(self, inputs: LoweringInputs) -> dict[tuple, Callable[[], Any]]:
        pairs = np.zeros((2, self.num_rows), np.int32)
        return {("state_copy",): functools.partial(self._copy.lower, inputs.kv, pairs, pairs)}

    def prepare(self, so: SchedulerOutput, ib: InputBatch, params: list, executables) -> None:
        """The step's restores, and its saves (copied before the next step's forward)."""
        row_of, n = ib.req_id_to_row, self.num_rows
        self.restores = [(n + slot, row_of[r]) for r, slot in so.state_restores.items()]
        self.saves = [(row_of[r], n + slot) for r, slot in so.state_saves.items()]

    def load(self, so: SchedulerOutput, kv_caches: Any, executables) -> Any:
        if self.pending_saves or self.restores:
            kv_caches = executables["state_copy",](
                kv_caches, self._pairs(self.pending_saves), self._pairs(self.restores)
            )
        self.pending_saves, self.restores = self.saves, []
        return kv_caches

    def _pairs(self, pairs: list[tuple[int, int]]) -> np.ndarray:
        """i32[2, max_num_seqs]: (sources, destinations), padded past every state row."""
        out = np.full((2, self.num_rows), self.num_rows + self.num_slots, np.int32)
        if pairs:
            out[:, : len(pairs)] = np.array(pairs, np.int32).T
        return out
