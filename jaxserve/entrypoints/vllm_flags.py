"""Every flag of `vllm serve` on `jaxserve serve`: a vLLM launch line never fails on
"unrecognized arguments".

vllm_serve_flags.json lists vLLM's flags (read once from vLLM's own parser by
scripts/vllm_serve_flags.py). A flag jaxserve implements is its own (cli.py, cli_args.py);
each other one is added here as one of:
- NO_OP: accepted with any value, with no effect, for the reason given (a CUDA or PyTorch
  knob with nothing to set under XLA, or behaviour jaxserve always has); the start-up log names
  the ones given;
- AT_DEFAULT: accepted at vLLM's default (and the values listed), which is what jaxserve
  does; any other value is refused by name, with the reason (a feature jaxserve lacks).

Before the parser, cli.py gives the command line vLLM's spellings (vllm_argv.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from jaxserve.entrypoints.vllm_argv import json_or_str

FLAGS_FILE = pathlib.Path(__file__).with_name("vllm_serve_flags.json")

_CUDA = "CUDA graphs and torch.compile: XLA compiles every step shape at start-up"
_KERNELS = "a CUDA / ROCm kernel choice: jaxserve's kernels are its own (Pallas, XLA)"
_TORCH_DIST = "torch.distributed / NCCL / Ray tuning: jaxserve runs on jax.distributed"
_LOADING = "a PyTorch checkpoint loader setting: jaxserve reads safetensors / GGUF its own way"
_LOGGING = "request logging: jaxserve's access log has a line per request, never its contents"
_NOT_COHERE = "the Cohere API's setting: jaxserve serves no Cohere route"
_DP_ONE_HOST = "jaxserve's data parallelism is -dp engine processes behind one API server"
_NO_PLUGIN = "jaxserve imports no Python named on its command line"
_NO_CP = "context parallelism: jaxserve has none (tensor, pipeline, data and expert only)"
_NO_OFFLOAD = "weight offloading to host memory: jaxserve keeps weights on the device"
_NO_MAMBA = "jaxserve's linear-attention state has one dtype and layout (the model's)"

# dest -> why it is accepted and ignored
NO_OP: dict[str, str] = {
    "enforce_eager": _CUDA,
    "cudagraph_capture_sizes": _CUDA,
    "max_cudagraph_capture_size": _CUDA,
    "compilation_config": _CUDA,
    "optimization_level": _CUDA,
    "cudagraph_metrics": _CUDA,
    "sleep_mode_offload_cudagraph": _CUDA,
    "enable_layerwise_nvtx_tracing": "NVTX ranges: profile jaxserve with jax.profiler",
    "jit_monitor_mode": "torch.compile's monitor: jaxserve compiles nothing while serving",
    "jit_monitor_verbose": "torch.compile's monitor: jaxserve compiles nothing while serving",
    "performance_mode": "jaxserve pads each step to buckets compiled at start-up",
    "enable_chunked_prefill": "chunked prefill is always on in jaxserve",
    "disable_chunked_mm_input": "jaxserve schedules an image's tokens whole",
    "scheduler_reserve_full_isl": "jaxserve admits a request once its prompt's blocks fit",
    "trust_remote_code": "jaxserve runs no code from a model's repository: its models are its "
    "own implementations",
    "allow_deprecated_quantization": "jaxserve warns about no quantization method",
    "disable_cascade_attn": "jaxserve has no cascade attention",
    "kv_sharing_fast_prefill": "jaxserve's prefill runs every layer",
    "swa_bounded_replay": "jaxserve keeps a sliding-window layer's blocks for the whole prompt",
    "prefix_caching_hash_algo": "jaxserve keys prefix blocks by its own hash of the tokens "
    "(cache_keys.py)",
    "attention_config": _KERNELS,
    "kernel_config": _KERNELS,
    "ir_op_priority": _KERNELS,
    "moe_backend": _KERNELS,
    "linear_backend": _KERNELS,
    "sparse_indexer_topk_backend": _KERNELS,
    "mamba_backend": _KERNELS,
    "mamba_ssu_algorithm": _KERNELS,
    "gdn_prefill_backend": _KERNELS,
    "kda_prefill_backend": _KERNELS,
    "kda_decode_backend": _KERNELS,
    "mm_encoder_attn_backend": _KERNELS,
    "enable_flashinfer_autotune": _KERNELS,
    "use_fp64_gumbel": "jaxserve samples with JAX's PRNG",
    "enable_cumem_allocator": "CUDA memory pools: XLA allocates device memory",
    "enable_nccl_comm_suspend": _TORCH_DIST,
    "distributed_timeout_seconds": _TORCH_DIST,
    "cpu_distributed_timeout_seconds": _TORCH_DIST,
    "disable_custom_all_reduce": _TORCH_DIST,
    "ray_workers_use_nsight": _TORCH_DIST,
    "max_parallel_loading_workers": _TORCH_DIST,
    "all2all_backend": _TORCH_DIST,
    "disable_nccl_for_dp_synchronization": _TORCH_DIST,
    "dp_sync_interval": _TORCH_DIST,
    "enable_dbo": "dual-batch overlap: XLA schedules communication with compute itself",
    "dbo_decode_token_threshold": "dual-batch overlap: XLA schedules communication itself",
    "dbo_prefill_token_threshold": "dual-batch overlap: XLA schedules communication itself",
    "ubatch_size": "dual-batch overlap: XLA schedules communication with compute itself",
    "enable_hc_sp": _TORCH_DIST,
    "enable_batch_sharded_sampling": "jaxserve samples on the device the logits are on",
    "enable_ep_weight_filter": "jaxserve reads each expert's weights once, on its device",
    "enable_shm_tensor_arena": "jaxserve sends step inputs over ZeroMQ",
    "numa_bind": "NUMA binding: pin the process with numactl",
    "numa_bind_nodes": "NUMA binding: pin the process with numactl",
    "numa_bind_cpus": "NUMA binding: pin the process with numactl",
    "data_parallel_supervisor_port": _DP_ONE_HOST,
    "dp_supervisor_probe_interval_s": _DP_ONE_HOST,
    "dp_supervisor_probe_timeout_s": _DP_ONE_HOST,
    "dp_supervisor_probe_failure_threshold": _DP_ONE_HOST,
    "safetensors_load_strategy": _LOADING,
    "safetensors_prefetch_num_threads": _LOADING,
    "safetensors_prefetch_block_size": _LOADING,
    "pt_load_map_location": _LOADING,
    "use_tqdm_on_load": _LOADING,
    "renderer_num_workers": "jaxserve's chat templates render in a pool it sizes itself",
    "mm_processor_cache_gb": "jaxserve caches encoder outputs, not processor inputs",
    "mm_processor_cache_type": "jaxserve caches encoder outputs, not processor inputs",
    "mm_shm_cache_max_object_size_mb": "jaxserve caches encoder outputs, not processor inputs",
    "mm_hasher_algorithm": "jaxserve hashes images its own way (cache_keys.py)",
    "mm_tensor_ipc": "jaxserve sends images to the engine core over ZeroMQ",
    "mm_processor_device": "jaxserve preprocesses images on the host",
    "mm_ipc_gpu_memory_gb": "jaxserve sends images to the engine core over ZeroMQ",
    "mm_device_do_normalize": "jaxserve preprocesses images on the host",
    "skip_mm_profiling": "jaxserve sizes the KV cache without a profiling run",
    "fully_sharded_loras": "jaxserve shards LoRA weights as their base layers",
    "specialize_active_lora": "jaxserve compiles one LoRA step for any adapter set",
    "enable_log_requests": _LOGGING,
    "enable_log_outputs": _LOGGING,
    "enable_log_deltas": _LOGGING,
    "max_log_len": _LOGGING,
    "aggregate_engine_logging": "jaxserve logs one line for all its engines",
    "fail_on_environ_validation": "jaxserve reads no VLLM_* variable it does not know",
    "show_hidden_metrics_for_version": "jaxserve hides no deprecated metrics",
    "collect_detailed_traces": "jaxserve's OpenTelemetry spans have one level of detail",
    "kv_cache_metrics_sample": "jaxserve has no sampled KV cache metrics",
    "disable_fastapi_docs": "jaxserve serves no /docs pages",
    "enable_offline_docs": "jaxserve serves no /docs pages",
    "cohere_is_reasoning_model": _NOT_COHERE,
    "cohere_format": _NOT_COHERE,
    "enable_flash_late_interaction": "jaxserve has no late-interaction (ColBERT) scoring",
    "ec_manager_config": "jaxserve's encoder cache sizes itself",
}

# dest -> (values accepted besides vLLM's default, why any other value is refused)
AT_DEFAULT: dict[str, tuple[tuple[Any, ...], str]] = {
    "config_format": (("hf",), "jaxserve reads Hugging Face configs (and GGUF metadata)"),
    "model_impl": (("vllm",), "jaxserve runs its own implementation of each model"),
    "convert": (("none",), "serve an embedding model with --runner pooling"),
    "hf_config_path": ((), "the model's own config.json is read"),
    "code_revision": ((), "jaxserve runs no code from a model's repository"),
    "quantization_config": ((), "jaxserve reads the checkpoint's quantization_config"),
    "model_class_overrides": (({},), "jaxserve's models are its own implementations"),
    "model_loader_extra_config": (({},), "jaxserve's weight loader has no options"),
    "ignore_patterns": ((), "jaxserve downloads the files its loader reads"),
    "skip_tokenizer_init": ((), "jaxserve needs the tokenizer (prompts as text, stop strings)"),
    "logprobs_mode": ((), "logprobs are of the raw logits (before any sampling setting)"),
    "enable_return_routed_experts": ((), "jaxserve returns no expert routing"),
    "return_sampling_mask": ((), "jaxserve returns no sampling mask"),
    "enable_trace_replay": ((), "jaxserve has no trace replay"),
    "disable_sliding_window": ((), "sliding-window layers keep their window"),
    "sleep_preserve_parameter_names": ((), "sleep level 1 keeps every weight"),
    "logits_processors": ((), _NO_PLUGIN),
    "io_processor_plugin": ((), _NO_PLUGIN),
    "tool_parser_plugin": (("",), _NO_PLUGIN),
    "reasoning_parser_plugin": (("",), _NO_PLUGIN),
    "middleware": (([],), _NO_PLUGIN),
    "worker_cls": (("auto",), _NO_PLUGIN),
    "worker_extension_cls": (("",), _NO_PLUGIN),
    "scheduler_cls": ((), _NO_PLUGIN),
    "config": ((), "handled before parsing (normalize_argv)"),
    "grpc": ((), "jaxserve serves HTTP only"),
    "grpc_port": ((), "jaxserve serves HTTP only"),
    "uds": ((), "jaxserve listens on a TCP port (--host, --port)"),
    "enable_ssl_refresh": ((), "restart the server to take new certificates"),
    "h11_max_header_count": ((), "uvicorn's limit on headers is its own"),
    "enable_request_id_headers": ((), "jaxserve sends no X-Request-Id header"),
    "tokens_only": ((), "jaxserve's frontend renders and detokenizes"),
    "enable_scale_out": ((), "jaxserve has no scale-out mode"),
    "fingerprint_mode": ((), "jaxserve sends no system fingerprint"),
    "fingerprint_value": ((), "jaxserve sends no system fingerprint"),
    "trust_request_mm_kwargs": ((), "requests carry no multimodal processor arguments"),
    "response_role": ((), "an answer after a generation prompt is the assistant's"),
    "exclude_tools_when_tool_choice_none": ((), "tools are rendered whatever the choice"),
    "tool_strict_level": ((), "strict tools are constrained as a whole"),
    "tool_server": ((), "jaxserve runs no built-in tools"),
    "enable_per_request_metrics": ((), "jaxserve returns no per-request metrics"),
    "sse_keep_alive_interval": ((0,), "streams send no keep-alive comments"),
    "log_error_stack": ((), "errors are logged as their message"),
    "anthropic_disabled_thinking_effort": ((), "the Messages API's thinking is on or off"),
    "default_mm_loras": ((), "adapters are named by the request"),
    "lora_target_modules": ((), "an adapter applies to every module it has weights for"),
    "enable_tower_connector_lora": ((), "adapters apply to the language model"),
    "enable_mixed_moe_lora_format": ((), "jaxserve serves no LoRA on experts"),
    "enable_moe_shared_loras": ((), "jaxserve serves no LoRA on experts"),
    "max_lora_cls_labels": ((), "jaxserve serves no classifier adapters"),
    "device_ids": ((), "choose devices with CUDA_VISIBLE_DEVICES"),
    "distributed_executor_backend": (
        ("mp", "uni"),
        "multi-host runs on jax.distributed (--nnodes, --node-rank)",
    ),
    "data_parallel_rank": ((), _DP_ONE_HOST),
    "data_parallel_start_rank": ((), _DP_ONE_HOST),
    "data_parallel_size_local": ((), _DP_ONE_HOST),
    "data_parallel_address": ((), _DP_ONE_HOST),
    "data_parallel_rpc_port": ((), _DP_ONE_HOST),
    "data_parallel_backend": ((), _DP_ONE_HOST),
    "data_parallel_hybrid_lb": ((), _DP_ONE_HOST),
    "data_parallel_external_lb": ((), _DP_ONE_HOST),
    "data_parallel_multi_port_external_lb": ((), _DP_ONE_HOST),
    "decode_context_parallel_size": ((), _NO_CP),
    "dcp_comm_backend": ((), _NO_CP),
    "dcp_q_replicate": ((), _NO_CP),
    "dcp_kv_cache_interleave_size": ((), _NO_CP),
    "cp_kv_cache_interleave_size": ((), _NO_CP),
    "prefill_context_parallel_size": ((), _NO_CP),
    "enable_eplb": ((), "jaxserve places experts once (no load balancer)"),
    "eplb_config": ((), "jaxserve places experts once (no load balancer)"),
    "enable_elastic_ep": ((), "jaxserve's expert parallelism has a fixed size"),
    "elastic_ep_max_dp_size": ((), "jaxserve's expert parallelism has a fixed size"),
    "expert_placement_strategy": ((), "experts are placed in order (linear)"),
    "enable_fault_tolerance": (
        (),
        "a dead engine core stops the server (a supervisor restarts it)",
    ),
    "fault_tolerance_config": ((), "a dead engine core stops the server"),
    "prefix_cache_retention_interval": ((), "cached blocks are evicted least recently used"),
    "kv_cache_dtype_skip_layers": ((), "--kv-cache-dtype applies to every layer"),
    "mamba_cache_dtype": ((), _NO_MAMBA),
    "mamba_ssm_cache_dtype": ((), _NO_MAMBA),
    "mamba_block_size": ((), _NO_MAMBA),
    "mamba_cache_mode": ((), _NO_MAMBA),
    "enable_mamba_cache_stochastic_rounding": ((), _NO_MAMBA),
    "mamba_cache_philox_rounds": ((), _NO_MAMBA),
    "enable_mamba_shared_prefix_checkpoint": ((), _NO_MAMBA),
    "replayssm_buffer_len": ((), _NO_MAMBA),
    "use_replayssm": ((), _NO_MAMBA),
    "prefix_match_unit": ((), "prefixes match in whole blocks (--block-size)"),
    "kv_offloading_backend": ((), "jaxserve's KV offloading is its own (native)"),
    "offload_backend": ((), _NO_OFFLOAD),
    "cpu_offload_gb": ((), _NO_OFFLOAD),
    "cpu_offload_params": ((), _NO_OFFLOAD),
    "offload_group_size": ((), _NO_OFFLOAD),
    "offload_num_in_group": ((), _NO_OFFLOAD),
    "offload_prefetch_step": ((), _NO_OFFLOAD),
    "offload_params": ((), _NO_OFFLOAD),
    "language_model_only": ((), "a multimodal model is served whole"),
    "enable_mm_embeds": ((), "images are given as images (image_url)"),
    "media_io_kwargs": (({},), "images are decoded with fixed, bounded settings"),
    "mm_processor_kwargs": ((), "the model's image processor runs with its own settings"),
    "mm_encoder_only": ((), "a multimodal model is served whole"),
    "mm_encoder_tp_mode": ((), "the vision encoder is sharded as its weights"),
    "mm_encoder_attn_dtype": ((), "the vision encoder runs in the model's dtype"),
    "mm_encoder_fp8_scale_path": ((), "the vision encoder runs in the model's dtype"),
    "mm_encoder_fp8_scale_save_path": ((), "the vision encoder runs in the model's dtype"),
    "mm_encoder_fp8_scale_save_margin": ((), "the vision encoder runs in the model's dtype"),
    "interleave_mm_strings": ((), "a message's images come first, in order"),
    "video_pruning_rate": ((), "jaxserve serves no video"),
    "video_pruning_method": ((), "jaxserve serves no video"),
    "per_request_spec_decode_metrics": ((), "speculative decoding's metrics are server-wide"),
    "kv_cache_metrics": ((), "jaxserve has no sampled KV cache metrics"),
    "custom_histogram_buckets": ((), "histograms have vLLM's default buckets"),
    "enable_mfu_metrics": ((), "jaxserve exports no utilization metrics"),
    "enable_logging_iteration_details": ((), "jaxserve logs no per-step details"),
    "max_num_scheduled_tokens": ((), "a step schedules up to --max-num-batched-tokens"),
    "max_num_active_seqs": ((), "a step runs up to --max-num-seqs sequences"),
    "max_num_queued_reqs": ((), "the waiting queue is bounded by memory only"),
    "max_num_queued_tokens": ((), "the waiting queue is bounded by memory only"),
    "long_prefill_token_threshold": ((), "prefill chunks are as long as the budget allows"),
    "long_prefill_token_threshold_adaptive": (
        (),
        "prefill chunks are as long as the budget allows",
    ),
    "watermark": ((), "jaxserve admits a request once its prompt's blocks fit"),
    "prefill_schedule_interval": ((), "prefills are scheduled every step"),
    "stream_interval": ((), "every step's tokens are streamed"),
    "spec_method": ((), "give --speculative-config"),
    "spec_model": ((), "give --speculative-config"),
    "spec_tokens": ((), "give --speculative-config"),
    "watermark_config": ((), "jaxserve has no watermarking"),
    "diffusion_config": ((), "jaxserve serves no diffusion models"),
    "kv_events_config": ((), "jaxserve publishes no KV cache events"),
    "ec_transfer_config": ((), "jaxserve transfers no encoder caches"),
    "engram_config": ((), "jaxserve has no engram memory"),
    "reasoning_config": ((), "give --reasoning-parser"),
    "additional_config": (({},), "jaxserve has no platform plugins"),
    "aux_output_config": ((), "jaxserve returns no auxiliary outputs"),
    "profiler_config": ((), "profile jaxserve with jax.profiler"),
    "weight_transfer_config": ((), "weight transfer is configured per call (docs/rl.md)"),
    "logging_config": ((), "jaxserve logs with logging's basic configuration"),
    "log_config_file": ((), "jaxserve logs with logging's basic configuration"),
}


def vllm_flags() -> list[dict[str, Any]]:
    """vLLM's `serve` flags: [{"flags", "dest", "kind", "default"}] (vllm_serve_flags.json)."""
    return json.loads(FLAGS_FILE.read_text())["flags"]


class _Accepted(argparse.Action):
    """A vLLM flag jaxserve accepts (NO_OP, or AT_DEFAULT at an accepted value) or refuses:
    the parser errors with the flag, the value and the reason."""

    def __init__(self, option_strings, dest, *, accepted=None, reason="", negated=(), **kw):
        super().__init__(option_strings, dest, **kw)
        self.accepted, self.reason, self.negated = accepted, reason, negated

    def __call__(self, parser, namespace, values, option_string=None):
        if self.nargs == 0:  # --x / --no-x
            values = option_string not in self.negated
        if self.accepted is not None and not _accepted(values, self.accepted):
            shown = option_string if self.nargs == 0 else f"{option_string} {values}"
            parser.error(f"{shown}: not supported by jaxserve: {self.reason}")
        ignored = getattr(namespace, "vllm_ignored_flags", None) or []
        if self.accepted is None:
            ignored.append((option_string, self.reason))
        namespace.vllm_ignored_flags = ignored


def _accepted(values: Any, accepted: tuple[Any, ...]) -> bool:
    """A flag's value(s) among the accepted: a list as a whole or each of its values."""
    if isinstance(values, list):
        return _matches(values, accepted) or all(_matches(v, accepted) for v in values)
    return _matches(values, accepted)


def _matches(value: Any, accepted: tuple[Any, ...]) -> bool:
    """A command-line string (or bool) equal to an accepted value, compared as JSON."""
    if isinstance(value, str):
        value = json_or_str(value)
    return any(value == a or str(value) == str(a) for a in accepted)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Adds to `parser` (after its own flags) every vLLM serve flag it lacks, as NO_OP or
    AT_DEFAULT says; a vLLM flag in neither table is a KeyError here (a new vLLM flag must be
    decided on when vllm_serve_flags.json is regenerated). A missing alias of a flag the
    parser has (`-asc`, `--device-memory-utilization`) is added to that flag."""
    own = parser._option_string_actions
    group = parser.add_argument_group(
        "vLLM flags", "accepted for vLLM launch lines (docs/serving.md#vllm-flags)"
    )
    for flag in vllm_flags():
        names = [n for n in flag["flags"] if not n.startswith("--no-")]
        mine = next((own[n] for n in flag["flags"] if n in own), None)
        if mine is not None:
            for name in names:
                own.setdefault(name, mine)
            continue
        dest = flag["dest"]
        if dest in NO_OP:
            accepted, reason = None, NO_OP[dest]
        else:
            values, reason = AT_DEFAULT[dest]
            accepted = (flag["default"], *values)
        kind = flag["kind"]
        nargs = {"bool": 0, "switch": 0, "values": "+", "append": None, "value": None}[kind]
        negated = tuple(n for n in flag["flags"] if n.startswith("--no-"))
        group.add_argument(
            *names,
            *negated,
            dest=f"vllm_{dest}",
            nargs=nargs,
            default=None,
            metavar="V",
            action=_Accepted,
            accepted=accepted,
            reason=reason,
            negated=negated,
            help=f"{'ignored' if accepted is None else 'vLLM default only'}: {reason}",
        )
