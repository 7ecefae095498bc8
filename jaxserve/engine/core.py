"""EngineCore: the scheduler, the KV cache manager and the model runner, one step at a time.

    step() = schedule() -> runner.dispatch() -> runner.fetch() -> update_from_output()

With async scheduling (the default) the core keeps one step in flight: step() schedules and
dispatches step N+1, then fetches step N (the one host sync), so the device runs N+1 while the
host turns N into outputs and schedules N+2. Without it, each step is fetched right away.

It runs in the caller's process behind `InprocClient` (engine/core_client.py); the
multi-process engine puts it behind ZeroMQ with the same add_request / abort_requests / step
surface. What trainers and operators call between steps (sleep, new weights, scheduling
paused in place) is core_control.py's.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import jax
import msgspec

from jaxserve.config import EngineConfig
from jaxserve.config.speculative import KV_DRAFT_METHODS
from jaxserve.core.encoder_cache_manager import EncoderCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.distributed.kv_transfer import create_connector
from jaxserve.distributed.kv_transfer.base import BlockLayout, KVConnectorBase
from jaxserve.distributed.multihost import Leader
from jaxserve.engine.core_control import CoreControl
from jaxserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from jaxserve.lora_request import LoRARequest
from jaxserve.startup import StartupTimeline
from jaxserve.structured_output import StructuredOutputManager
from jaxserve.worker.build import build_runner
from jaxserve.worker.multihost import BroadcastRunner
from jaxserve.worker.runner_protocol import Runner
from jaxserve.worker.step_types import PendingStep

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.005  # how long an idle step waits for a compiling grammar


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        leader: Leader | None = None,
        engine_index: int = 0,
        runner: Runner | None = None,
    ):
        """leader: with a model spread over several hosts, the channel to the other ranks;
        every runner call that runs on the devices is then made on theirs too.
        engine_index: the data-parallel rank (a KV connector's producer port is offset by it).
        runner: one built already (worker/build.py::build_runner, e.g. with a compile_fn),
        without its KV cache; by default the core builds it."""
        self.config = config
        self.timeline = timeline = StartupTimeline()
        if runner is None:
            runner = build_runner(config, timeline)
        self.runner = runner if leader is None else BroadcastRunner(runner, leader)
        with timeline.phase("KV cache"):
            # Size the KV cache from what the weights left (compiling needs its shape); the
            # compiled steps' temporaries live in the headroom gpu_memory_utilization leaves.
            num_blocks = self.runner.determine_num_blocks()
            self.runner.initialize_kv_cache(num_blocks)
        with timeline.phase("step executables"):
            self.runner.compile_all(background=config.background_compile)
        self.kv_connector = self._make_kv_connector(engine_index)
        spec_method = config.speculative.method if config.speculative is not None else None
        self.structured_output_manager = StructuredOutputManager(config)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            self.structured_output_manager,
            speculative=config.speculative is not None,
            # async scheduling with drafts the devices propose: a request runs k placeholder
            # drafts while its previous step is in flight
            drafts_ahead=(
                config.speculative.num_speculative_tokens
                if spec_method in KV_DRAFT_METHODS and config.scheduler.async_scheduling
                else 0
            ),
            num_lookahead_tokens=(
                config.speculative.num_speculative_tokens if spec_method in KV_DRAFT_METHODS else 0
            ),
            # On CPU a step is compute-bound past a few tokens: drafts fill the step up to
            # 2 (k + 1) tokens, or the power of two its other tokens need (benchmarks/results).
            draft_step_tokens=(
                2 * (1 + config.speculative.num_speculative_tokens)
                if config.speculative is not None and jax.default_backend() == "cpu"
                else None
            ),
            connector=self.kv_connector,
            max_loras=config.lora.max_loras if config.lora is not None else 0,
            encoder_cache=self._encoder_cache(),
        )
        self.num_requests_added = 0  # since start-up (data-parallel balance, in get_state)
        # The batch queue: steps dispatched and not yet fetched. With pipeline parallelism,
        # one micro-batch per stage, each request in at most one of them; async scheduling is
        # the one-stage case (the next step may run on the in-flight step's placeholders).
        self.pipeline = config.parallel.pipeline_parallel_size > 1
        self.max_in_flight = (
            config.parallel.pipeline_parallel_size
            if self.pipeline
            else 2
            if config.scheduler.async_scheduling
            else 1
        )
        self.in_flight: deque[tuple[SchedulerOutput, PendingStep]] = deque()
        self.scheduling_paused = False  # (pause_scheduler: requests keep their place)
        self.control = CoreControl(self)  # sleep, weights, pause: engine/core_control.py

    def utility(self, name: str):
        """The utility call `name` (core_proc.py's UTILITY_METHODS): the core's own method or
        its control surface's; None for neither."""
        for owner in (self, self.control):
            method = getattr(owner, name, None)
            if callable(method) and not name.startswith("_"):
                return method
        return None

    def _encoder_cache(self) -> EncoderCacheManager | None:
        """A multimodal model's encoder cache bookkeeping (its rows are the runner's)."""
        spec = self.runner.encoder_cache_spec()
        if spec is None:
            return None
        return EncoderCacheManager(spec.num_rows, spec.budget, bidirectional=spec.bidirectional)

    def _make_kv_connector(self, engine_index: int) -> KVConnectorBase | None:
        """The KV connector `--kv-transfer-config` / `--kv-offloading-size` name, wired to
        the runner's block copies (distributed/kv_transfer)."""
        config = self.config
        if config.kv_transfer is None:
            return None
        identity = f"{config.model_path}|{config.load_format}|{config.model.quantization}"
        block_shape, dtype = self.runner.kv_layout()
        layout = BlockLayout(block_shape, dtype, f"{identity}|{config.seed}")
        connector = create_connector(config.kv_transfer, layout, engine_index)
        self.runner.set_kv_connector(connector)
        logger.info(
            "KV connector %s (%s), blocks of %.2f MiB",
            connector.name,
            config.kv_transfer.kv_role,
            layout.nbytes / 2**20,
        )
        return connector

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that cannot be taken in finishes at once with an error (its
        output comes with the next step's), never the engine."""
        self.num_requests_added += 1
        try:
            if self.control.is_sleeping():
                raise ValueError("the engine is asleep: wake_up() first")
            if request.lora_request is not None:  # loaded (and checked) on the host now
                self.runner.add_lora(request.lora_request, self._live_loras)
            if request.mm_features:
                self.runner.check_images(request.mm_features)
            self._check_fits(request)
            engine_request = Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                eos_token_id=request.eos_token_id,
                block_size=self.config.cache.block_size,
                arrival_time=request.arrival_time,
                priority=request.priority,
                cache_salt=request.cache_salt,
                kv_transfer_params=request.kv_transfer_params,
                lora_request=request.lora_request,
                mm_features=request.mm_features,
            )
        except Exception as e:
            logger.exception("request %s could not be added", request.request_id)
            error = EngineCoreOutput(request.request_id, [], "error", f"{type(e).__name__}: {e}")
            self.scheduler.pending_outputs.append(error)
            return
        self.scheduler.add_request(engine_request)

    def _check_fits(self, request: EngineCoreRequest) -> None:
        """ValueError for a request the whole KV pool cannot hold at its longest (its prompt,
        max_tokens and drafts' lookahead; a pool set small with num_gpu_blocks_override):
        admitted, it would preempt itself forever."""
        kv, sched = self.scheduler.kv_cache_manager, self.config.scheduler
        new = request.sampling_params.max_tokens or sched.max_model_len
        tokens = min(len(request.prompt_token_ids) + new, sched.max_model_len)
        tokens += self.scheduler.num_lookahead_tokens
        need = kv.most_blocks(tokens, sched.max_num_batched_tokens)
        pool = kv.block_pool.num_blocks - 1  # (the null block)
        if need > pool:
            raise ValueError(
                f"the request needs up to {need} KV blocks of {kv.block_size} tokens "
                f"({tokens} tokens), more than the KV cache's {pool}: lower max_tokens or give "
                "the cache more blocks (gpu_memory_utilization, num_gpu_blocks_override)"
            )

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Abort requests wherever they are (unknown ids are ignored); returns those aborted."""
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [r.request_id for r in aborted]

    def has_unfinished_requests(self) -> bool:
        """Requests to step, steps in flight, or outputs of requests that finished without a
        step (a failed grammar, a request that could not be added) still to send."""
        return (
            (self.scheduler.has_unfinished_requests() and not self.scheduling_paused)
            or bool(self.in_flight)
            or bool(self.scheduler.pending_outputs)
        )

    def step(self) -> EngineCoreOutputs | None:
        """Dispatch the next step if there is work, then finish the oldest step once
        max_in_flight are running (or nothing new could be scheduled). None: nothing finished
        this call (the first step of a burst, in flight)."""
        dispatched = False
        if self.scheduler.has_unfinished_requests() and not self.scheduling_paused:
            scheduler_output = self.scheduler.schedule(
                self.runner.max_step_tokens(), self._micro_batch_reqs()
            )
            pending = self.runner.dispatch(scheduler_output)
            if pending is not None:
                self.in_flight.append((scheduler_output, pending))
                dispatched = True
                if self.pipeline:
                    self._mark_in_pipeline(scheduler_output, True)
        self._sample_oldest()
        if not self.in_flight or (dispatched and len(self.in_flight) < self.max_in_flight):
            return self._outputs_outside_steps(dispatched)
        num_in_flight = len(self.in_flight)
        scheduler_output, pending = self.in_flight.popleft()
        runner_output = self.runner.fetch(pending)
        if self.pipeline:
            self._mark_in_pipeline(scheduler_output, False)
        self.process_aborts_mid_step()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._sample_oldest()
        stats = self.scheduler.make_stats()
        stats.num_batches_in_flight = num_in_flight
        return EngineCoreOutputs(outputs, stats, timestamp=time.time())

    def _micro_batch_reqs(self) -> int | None:
        """With pipeline parallelism, a micro-batch's share of the requests: the unfinished
        ones split evenly over the stages (balanced by count), so that pp micro-batches can be
        in flight; None (no limit) otherwise."""
        if not self.pipeline:
            return None
        s = self.scheduler
        return max(1, -(-(len(s.running) + len(s.waiting)) // self.max_in_flight))

    def _mark_in_pipeline(self, so: SchedulerOutput, value: bool) -> None:
        requests = self.scheduler.requests
        for req_id in so.num_scheduled_tokens:
            if (request := requests.get(req_id)) is not None:
                request.in_pipeline = value

    def _sample_oldest(self) -> None:
        """Dispatch the sampling of the oldest step in flight if it waits for a grammar
        bitmask: every step before it is processed, so its grammars are up to date."""
        if self.in_flight and self.in_flight[0][1].fetch is None:
            so, pending = self.in_flight[0]
            batch = pending.batch
            bitmask = self.scheduler.grammar_bitmask(
                batch.req_ids,
                so.sampled_req_ids,
                batch.first_row,
                batch.drafts,
                int(batch.num_rows.sum()),
            )
            self.in_flight[0] = (so, self.runner.dispatch_sample(pending, bitmask))

    def _outputs_outside_steps(self, dispatched: bool) -> EngineCoreOutputs | None:
        """Requests finished without a step (a failure of their own); with nothing
        to run but grammars compiling, wait a little for them instead of spinning."""
        outputs = self.scheduler.take_pending_outputs()
        if outputs:
            return EngineCoreOutputs(outputs, self.scheduler.make_stats(), timestamp=time.time())
        if not dispatched and not self.in_flight and self.scheduler.num_waiting_for_grammar:
            self.structured_output_manager.wait_for_grammars(GRAMMAR_POLL_S)
        elif not dispatched and not self.in_flight and self.scheduler.waiting_for_remote:
            self.kv_connector.wait_for_recving(GRAMMAR_POLL_S)
        return None

    def process_aborts_mid_step(self) -> None:
        """Hook: aborts that arrived while the step ran (the core process applies them here,
        so an aborted request's last token is never delivered)."""

    def get_state(self) -> dict:
        """What the core holds, for tests and debugging (a utility call)."""
        kv = self.scheduler.kv_cache_manager
        kv.check_no_leaks()
        return {
            "num_requests": len(self.scheduler.requests),
            "num_free_blocks": kv.block_pool.get_num_free_blocks(),
            "num_blocks": self.num_blocks,
            "total_preemptions": self.scheduler.total_preemptions,
            "num_requests_added": self.num_requests_added,
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def compile_status(self) -> dict:
        """How many of the step shapes are compiled (a utility call: the readiness probe's
        "every step shape compiled"); the engine serves before all are, with background
        compilation."""
        compiled, total = self.runner.compile_status()
        return {"compiled": compiled, "total": total, "fully_compiled": compiled == total}

    def _live_loras(self) -> set[int]:
        """The LoRA adapters (lora_int_id) of the requests the scheduler holds."""
        return {r.lora_int_id for r in self.scheduler.requests.values() if r.lora_int_id}

    def add_lora(self, lora: LoRARequest | dict) -> bool:
        """Load and check an adapter into the host cache (a utility call: a server's
        /v1/load_lora_adapter, vLLM's add_lora), so bad weights are refused before any
        request names them; raises what models/lora.py::load_adapter raises."""
        self.runner.add_lora(msgspec.convert(lora, LoRARequest), self._live_loras)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter's host copy and device slot (a utility call), once the requests
        that use it have finished."""
        self.runner.remove_lora(lora_int_id, self._live_loras())
        return True
