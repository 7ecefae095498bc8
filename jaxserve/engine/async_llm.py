"""AsyncLLM: the asyncio frontend (vLLM V1's AsyncLLM) that the HTTP server drives.

generate(prompt, params, request_id) -> async iterator of RequestOutput
  1. InputProcessor validates (ValueError naming the bad value; nothing is queued);
  2. the request is registered with the OutputProcessor and a per-request collector, and
     its n child requests go to the core (AsyncMPClient);
  3. one output-handler task pulls EngineCoreOutputs, runs the OutputProcessor, puts each
     RequestOutput into its request's collector, and aborts stop-string matches in the core;
  4. the generator yields from the collector until the output is finished.
A consumer that stops iterating (cancelled task, closed generator, client gone) aborts its
request in the core at once. A request that fails on its own (finish_reason "error": an
exception in its work in the core or in the output processor) raises RequestFailedError from
its generator alone. When the core dies, every waiting generator raises EngineDeadError and
new calls fail at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core_client import AsyncMPClient
from jaxserve.engine.exceptions import EngineDeadError, RequestFailedError
from jaxserve.engine.gc_heap import freeze_heap, unfreeze_heap
from jaxserve.engine.generation_gate import GenerationGate
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.ipc.messages import SchedulerStats
from jaxserve.lora_request import LoRARequest
from jaxserve.metrics.stats import IterationStats
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tracing import RequestTracer, init_tracer
from jaxserve.transformers_utils.config import log_generation_defaults
from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME
from jaxserve.transformers_utils.tokenizer import read_tokenizer

logger = logging.getLogger(__name__)


class RequestOutputCollector:
    """Holds at most one undelivered RequestOutput: a consumer that falls behind gets the
    outputs merged (DELTA: concatenated; CUMULATIVE / FINAL_ONLY: the newest), so memory stays
    bounded whatever the pace."""

    def __init__(self, kind: RequestOutputKind):
        self.delta = kind == RequestOutputKind.DELTA
        self.pending: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        both = isinstance(self.pending, RequestOutput) and isinstance(output, RequestOutput)
        if both and self.delta:
            _merge_delta(self.pending, output)
            output = self.pending
        if not isinstance(self.pending, Exception):
            self.pending = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.pending is None:
            await self.ready.wait()
        output, self.pending = self.pending, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.kv_transfer_params = new.kv_transfer_params
    into.metrics = new.metrics
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs


class _Aborted(Exception):
    """Put into a collector by abort(): ends that request's generator."""


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        client: AsyncMPClient,
        *,
        tokenizer: Any = None,
        default_sampling: dict | None = None,
        tracer: RequestTracer | None = None,
    ):
        """default_sampling: what a request leaves unset (default: config's generation
        config's; transformers_utils/config.py::generation_defaults). tracer: a span per
        finished request (--otlp-traces-endpoint; tracing.py::init_tracer)."""
        self.config = config
        self.tokenizer = tokenizer
        if default_sampling is None:
            default_sampling = log_generation_defaults(config)
        self.default_sampling = default_sampling
        self.input_processor = InputProcessor.from_config(
            config, tokenizer, max_tokens_cap=default_sampling.get("max_tokens")
        )
        self.output_processor = OutputProcessor(tokenizer, tracer)
        self.engine_core = client
        self.collectors: dict[str, RequestOutputCollector] = {}
        # pause and sleep (generation_gate.py): what `generate` waits at
        self.gate = GenerationGate(lambda *call: client.call_utility_async(*call), self.collectors)
        self.scheduler_stats = SchedulerStats()
        # anything with record(SchedulerStats | None, IterationStats, engine index)
        self.stat_loggers: list[Any] = []
        self.output_handler: asyncio.Task | None = None
        self.dead: EngineDeadError | None = None
        self.frozen = True
        freeze_heap()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        """Starts the engine core process (blocking: load, compile) and, meanwhile, reads the
        tokenizer in a thread. A tracer's missing SDK fails first, before anything starts."""
        tracer = init_tracer(args.otlp_traces_endpoint, args.model or DEFAULT_MODEL_NAME)
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(read_tokenizer, args.tokenizer_source(), args.tokenizer_mode)
            client = AsyncMPClient(args)
            start = time.perf_counter()
            engine = cls(client.config, client, tokenizer=tokenizer.result(), tracer=tracer)
        client.timeline.add("frontend set-up (after the engine core)", time.perf_counter() - start)
        return engine

    @property
    def errored(self) -> bool:
        return self.dead is not None or self.engine_core.poll_dead() is not None

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def num_blocks(self) -> list[int] | None:
        """Each engine's KV-cache blocks, as they reported them when ready (None: a client
        without that report, such as a test's stand-in core)."""
        info = getattr(self.engine_core, "info", None)
        return None if info is None else info.num_blocks

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutputs (per sampling_params.output_kind) until it
        finishes. Raises ValueError for bad input, RequestFailedError if it fails alone,
        EngineDeadError if the core dies.
        data_parallel_rank: run it on that engine (default: the least loaded).
        kv_transfer_params: for the engine's KV connector (disaggregated prefill). A prompt
        dict's "cache_salt" keeps its prefix-cache entries apart from other salts' (vLLM's).
        lora_request: the LoRA adapter to run it with (--enable-lora).
        trace_headers: the caller's W3C trace context (traceparent, tracestate): its span's
        parent (vLLM's)."""
        if self.errored:
            raise self.dead or self.engine_core.dead
        if request_id in self.collectors:
            raise ValueError(f"request_id {request_id!r} is already running")
        self._start_output_handler()
        await self.gate.wait_until_resumed()  # paused or asleep (generation_gate.py)
        text, ids = self.input_processor.tokenize(prompt)
        request = self.input_processor.process(
            request_id,
            ids,
            sampling_params,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            **self.input_processor.prompt_extras(prompt),
            lora_request=lora_request,
        )
        request.data_parallel_rank = data_parallel_rank
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        self.collectors[request_id] = collector
        finished = False
        try:
            added = self.output_processor.add_request(text, request, trace_headers)
            self.engine_core.add_requests(added)
            while not finished:
                try:
                    output = await collector.get()
                except _Aborted:
                    return
                finished = output.finished
                errors = [c.stop_reason for c in output.outputs if c.finish_reason == "error"]
                if errors:
                    raise RequestFailedError(f"request {request_id} failed: {errors[0]}")
                yield output
        finally:  # cancelled, closed early or failed: nothing may stay in the core
            self.collectors.pop(request_id, None)
            if not finished and not self.errored:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks in the core; unknown ids are ignored."""
        stats = IterationStats()
        core_ids = self.output_processor.abort_request(request_id, stats)
        engine = self.engine_core.engine_of(core_ids[0]) if core_ids else 0
        self.engine_core.abort_requests(core_ids)
        for stat_logger in self.stat_loggers:
            stat_logger.record(None, stats, engine)
        collector = self.collectors.pop(request_id, None)
        if collector is not None:  # its generator ends without a further output
            collector.put(_Aborted())

    def _start_output_handler(self) -> None:
        if self.output_handler is None or self.output_handler.done():
            self.output_handler = asyncio.get_running_loop().create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        try:
            while True:
                core_outputs = await self.engine_core.get_output_async()
                if core_outputs.scheduler_stats is not None:
                    self.scheduler_stats = core_outputs.scheduler_stats
                stats = IterationStats()
                outputs, to_abort = self.output_processor.process_outputs(
                    core_outputs.outputs, stats
                )
                for stat_logger in self.stat_loggers:
                    try:
                        stat_logger.record(
                            core_outputs.scheduler_stats, stats, core_outputs.engine_index
                        )
                    except Exception:  # metrics are nobody's request: never fatal
                        logger.exception("stat logger %r failed", stat_logger)
                for output in outputs:
                    collector = self.collectors.get(output.request_id)
                    if collector is not None:
                        collector.put(output)
                self.engine_core.abort_requests(to_abort)
        except EngineDeadError as e:
            self.dead = e
        except Exception as e:  # reaching the core failed: fail loudly, never hang
            self.dead = EngineDeadError(f"the output handler failed: {e!r}")
        for collector in self.collectors.values():
            collector.put(self.dead)

    async def call_utility(self, method: str, *args: Any) -> Any:
        return await self.engine_core.call_utility_async(method, *args)

    # ------------------------------------------------------------------ pause and sleep
    async def pause_generation(
        self,
        mode: str = "abort",
        clear_cache: bool = True,
        *,
        wait_for_inflight_requests: bool = False,
    ) -> None:
        """Stop generating: "abort" (default), "wait" or "keep" (generation_gate.py);
        wait_for_inflight_requests: vLLM's older "wait"."""
        await self.gate.pause("wait" if wait_for_inflight_requests else mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.gate.resume()

    async def is_paused(self) -> bool:
        return self.gate.is_paused()

    async def sleep(self, level: int = 1) -> None:
        """Free the device memory (what runs is aborted first, unless paused already)."""
        await self.gate.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.gate.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return await self.gate.is_sleeping()

    # ------------------------------------------------------------------ weights, runner calls
    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        await self.call_utility("init_weight_transfer_engine", init_info)

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        await self.call_utility("start_weight_update", is_checkpoint_format)

    async def update_weights(self, update_info: dict) -> None:
        """Stage the tensors `update_info` names (applied by finish_weight_update)."""
        await self.call_utility("update_weights_from", update_info)

    async def finish_weight_update(self) -> Any:
        return await self.call_utility("finish_weight_update")

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility("reset_prefix_cache"))

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """A model-runner method on every worker of every engine: their results. By name only
        (engine/core_control.py's COLLECTIVE_RPC_METHODS): functions are LLM.collective_rpc's,
        never sent from a server."""
        if not isinstance(method, str):
            raise ValueError(f"collective_rpc takes a method name, got {type(method).__name__}")
        call = self.call_utility("collective_rpc", method, list(args), kwargs or {})
        result = await asyncio.wait_for(call, timeout)
        if self.config.parallel.data_parallel_size > 1:  # one list per engine
            return [r for engine in result for r in engine]
        return result

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter into every engine's host cache, checked (vLLM's add_lora):
        ValueError naming what is wrong with it (a tensor of the wrong shape, a NaN, a file
        that is no safetensors file), before any request names it."""
        try:
            await self.call_utility("add_lora", lora)
        except EngineDeadError:
            raise
        except RuntimeError as e:  # the engine's failure message: "ValueError: adapter ..."
            raise ValueError(f"LoRA adapter {lora.lora_name!r} cannot be loaded: {e}") from None

    async def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter's weights from every engine's slots and host cache (requests
        running with it finish first: the engines keep what those still need)."""
        await self.call_utility("remove_lora", lora_int_id)

    def shutdown(self) -> None:
        if self.output_handler is not None:
            self.output_handler.cancel()
        self.engine_core.shutdown()
        if self.frozen:
            self.frozen = False
            unfreeze_heap()
