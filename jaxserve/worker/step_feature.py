"""An optional feature of the model runner's step as one object: LoRA slots
(lora_slots.py), images or prompt embeddings (encoder_runner.py, prompt_embeds.py), pooling
(pooler.py), a KV connector's block copies (kv_block_io.py), a hybrid model's kept states
(state_slots.py). The runner holds the features it
was built with (step_features.py::build_features) and calls each hook of each in turn, so a
feature is a module and a line there, never a branch in the runner:

  lowerings       its compiled programs, lowered with the step's at start-up
  attach          where the model's parameters sit in the runner's flat list
  forget          a request finished or was preempted
  prepare         its per-row state from the step's SchedulerOutput, after the input batch's
                  update and before the step's inputs are built (may run its own programs)
  forward_inputs  its fields of the forward's inputs (batch None: padding at start-up)
  load            before the forward: what it writes into the KV cache
  after_forward   after the forward: device values kept until the step is fetched
  finish          at fetch, those values on the host, into the ModelRunnerOutput

Every hook's default does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_types import ForwardInputs, StepBatch


class LoweringInputs(NamedTuple):
    """What a feature's programs are lowered with at start-up."""

    params: list  # the runner's flat parameter arrays
    model_def: Any  # step_functions.ModelDef
    kv: Any  # the KV caches as ShapeDtypeStructs
    token_buckets: tuple[int, ...]
    hidden: Callable[[int], jax.ShapeDtypeStruct]  # [t, D] hidden states of token bucket t


class StepFeature:
    """The hooks a feature of the step implements (defaults: nothing)."""

    name = ""  # its entry in PendingStep.features and the fetched values

    def cache_key(self) -> dict[str, str]:
        """Parts of the executables' key beyond the engine configuration."""
        return {}

    def lowerings(self, inputs: LoweringInputs) -> dict[tuple, Callable[[], Any]]:
        return {}

    def attach(self, state: Any) -> None:
        """state: the model's nnx.State, flattened in this order into the runner's params."""

    def forget(self, req_id: str) -> None:
        pass

    def prepare(self, so: SchedulerOutput, ib: InputBatch, params: list, executables) -> None:
        pass

    def forward_inputs(
        self,
        forward: ForwardInputs,
        batch: StepBatch | None,
        ib: InputBatch | None,
        *,
        spec: bool = False,
    ) -> ForwardInputs:
        """spec: lowering at start-up (device buffers as their shapes alone)."""
        return forward

    def load(self, so: SchedulerOutput, kv_caches: Any, executables) -> Any:
        """Returns the KV caches (updated)."""
        return kv_caches

    def after_forward(
        self, so: SchedulerOutput, batch: StepBatch, hidden: jax.Array, kv_caches: Any, executables
    ) -> Any:
        """hidden: [T, D] every token's final hidden state. A value (a pytree whose arrays
        are copied to the host with the step's results) or None."""
        return None

    def finish(
        self, batch: StepBatch, value: Any, ib: InputBatch, result: ModelRunnerOutput
    ) -> None:
        """value: after_forward's, on the host."""
