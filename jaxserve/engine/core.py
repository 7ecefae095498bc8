"""EngineCore: the scheduler, the KV cache manager and the model runner, one step at a time.

    step() = schedule() -> execute_model() -> update_from_output()

In this issue it runs in the caller's process (InprocClient); the multi-process issue puts it
behind ZeroMQ with the same add_request / abort_requests / step surface.
"""

from __future__ import annotations

import logging

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.ipc.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from jaxserve.models.loader import LoadedModel
from jaxserve.worker.model_runner import ModelRunner, enable_persistent_compilation_cache

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        loaded: LoadedModel,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        max_logprobs: int = 20,
        seed: int = 0,
    ):
        enable_persistent_compilation_cache()
        self.runner = ModelRunner(
            loaded, scheduler_config, cache_config, max_logprobs=max_logprobs, seed=seed
        )
        # Size the KV cache from what the weights left (compiling needs its shape); the
        # compiled steps' temporaries live in the headroom gpu_memory_utilization leaves.
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.compile_all()
        self.scheduler = Scheduler(scheduler_config, cache_config, num_blocks)
        self.block_size = cache_config.block_size
        self.last_stats = SchedulerStats()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                eos_token_id=request.eos_token_id,
                block_size=self.block_size,
                arrival_time=request.arrival_time,
                priority=request.priority,
                cache_salt=request.cache_salt,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.last_stats = self.scheduler.make_stats()
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()
