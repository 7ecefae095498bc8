"""What the engine core may call on a model runner (lifecycle step 7's interface).

Three runners implement it explicitly: `ModelRunner` (one process's devices, its forward as
one program or a pipeline's stages: stages.py, pipeline_stages.py), `BroadcastRunner` (rank 0
of several hosts: each call that runs programs on the devices is sent to the follower ranks
first) and `SimulatedRunner` (a cost model, no model). The engine core (engine/core.py,
core_control.py) calls nothing else on a runner, and probes for nothing: a feature the runner
was built without answers with the error its method raises (`add_lora` without `enable_lora`)
or with its empty value
(`encoder_cache_spec` of a text-only model is None).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.lora_request import LoRARequest
from jaxserve.multimodal.inputs import MultiModalFeature


class EncoderCacheSpec(NamedTuple):
    """A multimodal runner's encoder cache, as the scheduler's EncoderCacheManager sizes it."""

    num_rows: int  # rows of the device buffer
    budget: int  # the most image tokens one request may hold in it
    bidirectional: bool  # an image's tokens see each other (must run in one step)


class KVLayout(NamedTuple):
    """One KV block's shape and dtype on the host (what a KV connector stores)."""

    block_shape: tuple[int, ...]
    dtype: np.dtype


@runtime_checkable
class Runner(Protocol):
    """The model runner as the engine core sees it."""

    num_blocks: int  # KV blocks (0 until initialize_kv_cache)

    # start-up
    def determine_num_blocks(self) -> int: ...
    def initialize_kv_cache(self, num_blocks: int) -> None: ...
    def compile_all(self, background: bool = False) -> None: ...
    def compile_status(self) -> tuple[int, int]:
        """(step shapes compiled, step shapes in all)."""
        ...

    # a serving step
    def max_step_tokens(self) -> int: ...
    def dispatch(self, so: SchedulerOutput) -> Any | None: ...
    def dispatch_sample(self, pending: Any, bitmask: np.ndarray | None) -> Any: ...
    def fetch(self, pending: Any) -> ModelRunnerOutput: ...
    def dummy_step(self) -> None: ...

    # features, each answering for itself whether the runner was built with it
    def add_lora(self, request: LoRARequest, live: Any) -> None:
        """Load and check an adapter on the host (ValueError: LoRA not enabled, bad weights);
        live: a callable giving the lora_int_ids requests still use."""
        ...

    def remove_lora(self, lora_int_id: int, live: set[int]) -> None: ...
    def encoder_cache_spec(self) -> EncoderCacheSpec | None: ...
    def check_images(self, features: list[MultiModalFeature]) -> None:
        """ValueError for images this runner cannot serve (a text-only model, no compiled
        shape holds one, more tokens than the encoder cache or a step holds)."""
        ...

    def kv_layout(self) -> KVLayout: ...
    def set_kv_connector(self, connector: Any) -> None: ...
    def device_state(self) -> Any:
        """The runner's weights and KV cache as sleep, wake and weight updates move them
        (worker/device_state.py::DeviceState); ValueError for a runner without weights."""
        ...
