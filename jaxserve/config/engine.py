"""The engine's configuration: the KV cache, the scheduler's limits, the devices, and
`EngineConfig`, which gathers them with the model's and the optional features' configs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxserve.config.kv_groups import KVCacheLayout
from jaxserve.config.kv_transfer import DEFAULT_KV_TRANSFER_ALLOWED_HOSTS, KVTransferConfig
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.model import ModelConfig
from jaxserve.config.multimodal import MultiModalConfig
from jaxserve.config.pooler import PoolerConfig
from jaxserve.config.speculative import SpeculativeConfig

# --kv-cache-dtype values (vLLM's names) -> the cache's dtype; "auto": the model's dtype.
# "fp8" is e4m3, as vLLM has it on CUDA.
KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": jnp.bfloat16,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, prefix caching, and how much memory it may take."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # explicit budget; wins over the utilisation
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + KV cache
    num_gpu_blocks_override: int | None = None  # exact block count (tests, debugging)
    cache_dtype: str = "auto"  # --kv-cache-dtype: a KV_CACHE_DTYPES key
    # The layers' KV-cache groups by attention kind (config/kv_groups.py; None: one group of
    # full attention): a windowed group's blocks are given back as a request runs past them.
    kv_layout: KVCacheLayout | None = None
    # A hybrid model's linear-attention states kept for prefix-cache hits (core/state_cache.py):
    # slots beside the input-batch rows' states; 0: none (prefix caching off, or not hybrid).
    state_cache_slots: int = 0

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.cache_dtype!r} is not supported; choose from "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 2, got {self.num_gpu_blocks_override}"
            )

    @property
    def layout(self) -> KVCacheLayout:
        return self.kv_layout or KVCacheLayout.uniform(1)

    @property
    def grouped_layout(self) -> KVCacheLayout | None:
        """The layout when it has several groups (what the worker's arrays follow), else None:
        one group of every cached layer."""
        return self.kv_layout if self.kv_layout and self.kv_layout.num_groups > 1 else None

    def kv_dtype(self, model_dtype: Any) -> Any:
        """The dtype the KV cache is stored in (the model's own for "auto")."""
        return KV_CACHE_DTYPES[self.cache_dtype] or model_dtype


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. Chunked prefill is always on (vLLM V1)."""

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: str = "fcfs"  # fcfs | priority
    # Schedule step N+1 while step N runs on the device (EngineCore keeps one step in flight).
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices: tensor parallelism over one process's devices.

    Checked here without looking at any device; whether this process has the devices is
    checked where the engine config is resolved (distributed/mesh.py::check_local_devices)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # a mixture of experts' experts split over the devices
    # Engines, each with its own tensor_parallel_size devices, scheduler and KV cache (not part
    # of an engine's executables: kept out of the config's repr, their cache key)
    data_parallel_size: int = dataclasses.field(default=1, repr=False)
    # Hosts one model spans (distributed/multihost.py): each runs tensor_parallel_size x
    # pipeline_parallel_size / nnodes of the devices, one process per host
    nnodes: int = 1
    # Pipeline stages (config/pipeline.py splits the layers); the engine core keeps up to
    # this many micro-batches in flight (engine/core.py's batch queue)
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}"
            )
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size * self.pipeline_parallel_size < self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                f"{self.pipeline_parallel_size} cannot span nnodes={self.nnodes}: every node "
                "needs at least one device"
            )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs to start: built by `EngineArgs.create_engine_config`.

    Picklable, so the multi-process engine can hand it to the core process as is.
    """

    model_path: str  # resolved: a HF directory, a .gguf file or a jaxserve checkpoint
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    seed: int = 0
    max_logprobs: int = 20
    attention_backend: str = "reference"  # "pallas" (the kernel) or "reference" (jnp)
    load_format: str = "auto"  # "dummy": random weights of the model's shapes
    # HF config fields set over the checkpoint's (--hf-overrides); `model` already has them
    hf_overrides: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    tokenizer_path: str | None = None  # default: model_path (structured outputs read it)
    tokenizer_mode: str = "auto"  # "deepseek_v32": DeepSeek-V3.2's prompt encoding
    reasoning_parser: str | None = None  # structured outputs bind after the reasoning ends
    pooler: PoolerConfig | None = None  # set: a pooling runner (embeddings), no generation
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # --enable-lora: adapters in device slots (models/lora.py)
    # --enable-prompt-embeds: prompts as embeddings, through the encoder cache's rows
    # (worker/prompt_embeds.py); the forward then reads those rows at every step
    enable_prompt_embeds: bool = False
    # --enable-sleep-mode: the engine may free its device memory (EngineCore.sleep)
    enable_sleep_mode: bool = dataclasses.field(default=False, compare=False)
    # Ready once the step shapes that can serve any step are; the rest in the background
    # (ModelRunner.compile_all). Not part of what the executables depend on: no repr.
    background_compile: bool = dataclasses.field(default=False, compare=False, repr=False)
    # A KV connector (distributed/kv_transfer); its block copies are compiled beside the steps.
    kv_transfer: KVTransferConfig | None = dataclasses.field(default=None, repr=False)
    # The hosts a request's kv_transfer_params may name as its KV's source (remote_host);
    # checked by the frontend's InputProcessor (distributed/kv_transfer/params.py).
    kv_transfer_allowed_hosts: tuple[str, ...] = dataclasses.field(
        default=DEFAULT_KV_TRANSFER_ALLOWED_HOSTS, compare=False, repr=False
    )
    # The frontend's default sampling parameters (transformers_utils/config.py::
    # generation_defaults): "auto" | "vllm" | a directory, and the override's fields.
    generation_config: str = dataclasses.field(default="auto", compare=False, repr=False)
    override_generation_config: dict = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    # Image inputs' limits and local media directory (the frontend's checks, not the steps')
    multimodal: MultiModalConfig = dataclasses.field(
        default_factory=MultiModalConfig, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}")
        if self.scheduler.max_model_len > self.model.max_model_len:
            raise ValueError(
                f"max_model_len={self.scheduler.max_model_len} exceeds the model's "
                f"{self.model.max_model_len}"
            )
