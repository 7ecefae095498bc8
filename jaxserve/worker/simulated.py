"""A model runner that runs no model, for judging the serving layers at scales the machine
cannot hold (benchmarks/bench_dp_scale.py): each step takes the time a cost model gives,

    step time = base + per_token * scheduled tokens,

one step at a time as on a device, and samples random tokens. With pipeline_parallel_size
= pp the step runs as pp stages of step time / pp each, on pp devices: a micro-batch's stage s
starts once its stage s - 1 is done and stage s has finished the micro-batch before it, so
up to pp micro-batches overlap (the engine core's batch queue keeps them in flight), and one
alone leaves pp - 1 stages idle (the pipeline bubble). Everything else (scheduler, KV
block manager, engine core processes, ZeroMQ, the DP coordinator and load balancer, the
frontend) is the real thing. The engine core builds it instead of the real runner when
$JAXSERVE_SIMULATED_STEP is "BASE_MS,PER_TOKEN_MS" (worker/build.py::build_runner); the model
is only read for its configuration (e.g. `--load-format dummy` with a preset).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

SIMULATE_ENV = "JAXSERVE_SIMULATED_STEP"
DEFAULT_NUM_BLOCKS = 8192


class SimulatedStep(NamedTuple):
    req_ids: list[str]
    done_at: float  # time.monotonic() when the simulated device finishes it
    fetch: bool = True  # (EngineCore: a dispatched step's sampling is dispatched too)


class SimulatedRunner:
    """ModelRunner's interface over the cost model."""

    def __init__(self, config: EngineConfig, spec: str):
        try:
            base_ms, per_token_ms = (float(x) for x in spec.split(","))
        except ValueError:
            raise ValueError(f"${SIMULATE_ENV}={spec!r} is not BASE_MS,PER_TOKEN_MS") from None
        self.base_s, self.per_token_s = base_ms / 1e3, per_token_ms / 1e3
        self.config = config
        self.num_blocks = 0
        self.rng = np.random.default_rng(config.seed)
        self.stages = config.parallel.pipeline_parallel_size
        self.busy_until = [0.0] * self.stages  # when each stage's device is free
        self.busy_total = 0.0  # seconds of stage work dispatched, over every stage

    def determine_num_blocks(self) -> int:
        return self.config.cache.num_gpu_blocks_override or DEFAULT_NUM_BLOCKS

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def compile_all(self, background: bool = False) -> None:
        pass

    def compile_status(self) -> tuple[int, int]:
        return 0, 0

    def max_step_tokens(self) -> int:
        return self.config.scheduler.max_num_batched_tokens

    # ------------------------------------------------------------------ features: none
    def add_lora(self, request, live) -> None:
        raise ValueError("this engine was started without enable_lora")

    def remove_lora(self, lora_int_id: int, live: set[int]) -> None:
        pass

    def encoder_cache_spec(self) -> None:
        return None

    def check_images(self, features: list) -> None:
        raise ValueError("a simulated runner takes no images")

    def kv_layout(self):
        raise ValueError("a simulated runner holds no KV cache")

    def set_kv_connector(self, connector) -> None:
        raise ValueError("a simulated runner holds no KV cache")

    def device_state(self):
        raise ValueError("a simulated runner holds no weights")

    def dummy_step(self) -> None:
        time.sleep(self.base_s)

    def dispatch(self, so: SchedulerOutput) -> SimulatedStep | None:
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return None
        stage_s = (self.base_s + self.per_token_s * so.total_num_scheduled_tokens) / self.stages
        ready = time.monotonic()
        self.busy_total += stage_s * self.stages
        for s in range(self.stages):  # each device runs one stage of one micro-batch at a time
            ready = self.busy_until[s] = max(ready, self.busy_until[s]) + stage_s
        return SimulatedStep(req_ids, ready)

    def dispatch_sample(self, pending: SimulatedStep, bitmask) -> SimulatedStep:
        return pending

    def fetch(self, pending: SimulatedStep) -> ModelRunnerOutput:
        wait = pending.done_at - time.monotonic()
        if wait > 0:  # (sleep(0) would still give the core away: a 0 ms step is not that)
            time.sleep(wait)
        vocab = self.config.model.vocab_size
        tokens = self.rng.integers(0, vocab, len(pending.req_ids)).astype(np.int32)
        return ModelRunnerOutput(pending.req_ids, tokens)
