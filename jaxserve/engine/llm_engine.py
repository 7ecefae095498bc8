"""LLMEngine: the synchronous frontend (vLLM V1's LLMEngine) that `LLM` drives.

    add_request: prompt -> InputProcessor -> EngineCoreRequest(s) -> core client
    step:        core client.get_output() -> OutputProcessor -> RequestOutputs
                 (stop strings found here abort their requests in the core)

A request with n > 1 runs as n child requests in the core, which share the prompt's blocks
through prefix caching; the output processor gathers them into one RequestOutput.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxserve import envs
from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core_client import EngineCoreClient, InprocClient, SyncMPClient
from jaxserve.engine.gc_heap import freeze_heap, unfreeze_heap
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.ipc.messages import EngineCoreRequest, SchedulerStats
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tracing import RequestTracer, init_tracer
from jaxserve.transformers_utils.config import log_generation_defaults
from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME
from jaxserve.transformers_utils.tokenizer import read_tokenizer


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        tokenizer: Any = None,
        default_sampling: dict | None = None,
        client: EngineCoreClient | None = None,
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
        self.engine_core = client if client is not None else InprocClient(config)
        self.scheduler_stats = SchedulerStats()
        self.frozen = True
        freeze_heap()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, multiprocess: bool | None = None) -> LLMEngine:
        """multiprocess (default: $JAXSERVE_ENABLE_MULTIPROCESSING, else on): the core runs in
        its own process (SyncMPClient); otherwise in this one (InprocClient). A tracer's
        missing SDK fails first, before anything starts."""
        tracer = init_tracer(args.otlp_traces_endpoint, args.model or DEFAULT_MODEL_NAME)
        if multiprocess is None:
            multiprocess = envs.JAXSERVE_ENABLE_MULTIPROCESSING
        if multiprocess:
            # The tokenizer is read while the core process starts (not beside an in-process
            # core: transformers' lazy imports are not thread-safe).
            with ThreadPoolExecutor(1) as pool:
                tokenizer = pool.submit(
                    read_tokenizer, args.tokenizer_source(), args.tokenizer_mode
                )
                client: EngineCoreClient = SyncMPClient(args)
                config = client.config
                tokenizer = tokenizer.result()
        else:
            config = args.create_engine_config()
            client = InprocClient(config)
            tokenizer = read_tokenizer(
                config.tokenizer_path or config.model_path, config.tokenizer_mode
            )
        return cls(config, tokenizer=tokenizer, client=client, tracer=tracer)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------------ requests in
    def process_inputs(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate (ValueError naming the bad value); queues nothing.
        kv_transfer_params: for the engine's KV connector (disaggregated prefill); a prompt
        dict's "cache_salt": its prefix-cache entries apart from other salts'."""
        text, ids = self.input_processor.tokenize(prompt)
        return text, self.input_processor.process(
            request_id,
            ids,
            params,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            **self.input_processor.prompt_extras(prompt),
            lora_request=lora_request,
        )

    def add_processed_request(self, text: str | None, request: EngineCoreRequest) -> None:
        self.engine_core.add_requests(self.output_processor.add_request(text, request))

    def add_processed_requests(self, requests: list[tuple[str | None, EngineCoreRequest]]) -> None:
        """Many at once: to the core in one message (each admitted by the same step)."""
        process = self.output_processor.add_request
        self.engine_core.add_request_groups([process(text, r) for text, r in requests])

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.add_processed_request(
            *self.process_inputs(
                request_id,
                prompt,
                params,
                priority=priority,
                kv_transfer_params=kv_transfer_params,
                lora_request=lora_request,
            )
        )

    def abort_request(self, request_ids: list[str]) -> None:
        """Forget the requests and free their blocks in the core; unknown ids are ignored."""
        core_ids = [cid for rid in request_ids for cid in self.output_processor.abort_request(rid)]
        self.engine_core.abort_requests(core_ids)

    # ------------------------------------------------------------------ outputs
    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.get_output()
        if core_outputs.scheduler_stats is not None:
            self.scheduler_stats = core_outputs.scheduler_stats
        outputs, to_abort = self.output_processor.process_outputs(core_outputs.outputs)
        self.engine_core.abort_requests(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter's weights from the engine (AsyncLLM.remove_lora)."""
        self.engine_core.call_utility("remove_lora", lora_int_id)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        if self.frozen:
            self.frozen = False
            unfreeze_heap()
