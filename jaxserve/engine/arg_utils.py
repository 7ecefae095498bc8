"""EngineArgs: the engine's keyword arguments (vLLM's names and defaults) -> EngineConfig.

`LLM(**kwargs)` and, later, `jaxserve serve --flags` both go through here, so a setting has one
name, one default and one validation wherever it is given.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from jaxserve.layers.attention import ATTENTION_BACKENDS
from jaxserve.models.loader import read_model_config, resolve_model_path

# Without an accelerator every (tokens, seqs) bucket pair is compiled on a few CPU cores:
# smaller limits keep start-up short.
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS = 64, 1024
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 256, 8192


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None  # None or "HuggingFaceTB/SmolLM2-135M-Instruct": bundled default
    tokenizer: str | None = None  # a HF tokenizer directory; default: the model's own
    load_format: str = "auto"  # "dummy": random weights (model: also a config.json or preset)
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: whole experts per device instead of F slices
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int | None = None  # default: 256 (64 on CPU)
    max_num_batched_tokens: int | None = None  # default: 8192 (1024 on CPU)
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # auto | bfloat16 | fp8 (e4m3) | fp8_e4m3 | fp8_e5m2
    max_logprobs: int = 20
    scheduling_policy: str = "fcfs"
    # Schedule step N+1 while step N runs. Default: on with an accelerator; off on CPU, where
    # the "device" is the host's own cores and the overlap slows the step it runs beside
    # (benchmarks/results/cpu.md).
    async_scheduling: bool | None = None
    # Paged attention: "pallas" (the Pallas kernel; default on GPU) or "reference" (the jnp
    # op; default elsewhere, where the kernel only runs interpreted).
    attention_backend: str | None = None
    reasoning_parser: str | None = None  # e.g. deepseek_r1, qwen3 (jaxserve/reasoning)
    quantization: str | None = None  # int8 | fp8 (at load) | gguf | compressed-tensors

    def create_engine_config(self) -> EngineConfig:
        """Validate every argument (ValueError naming it) and build the frozen configs."""
        path = resolve_model_path(self.model, self.load_format)
        model_config = read_model_config(path, self.dtype, self.quantization)
        on_cpu = jax.default_backend() == "cpu"
        if self.enable_expert_parallel and not model_config.num_experts:
            raise ValueError(
                f"enable_expert_parallel: {model_config.architecture} is not a mixture of experts"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        scheduler = SchedulerConfig(
            max_model_len=_or(self.max_model_len, model_config.max_model_len),
            max_num_seqs=_or(self.max_num_seqs, CPU_MAX_NUM_SEQS if on_cpu else MAX_NUM_SEQS),
            max_num_batched_tokens=_or(
                self.max_num_batched_tokens,
                CPU_MAX_NUM_BATCHED_TOKENS if on_cpu else MAX_NUM_BATCHED_TOKENS,
            ),
            policy=self.scheduling_policy,
            async_scheduling=not on_cpu if self.async_scheduling is None else self.async_scheduling,
        )
        attention_backend = self.attention_backend or (
            "pallas" if jax.default_backend() == "gpu" else "reference"
        )
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={attention_backend!r}; choose from {ATTENTION_BACKENDS}"
            )
        cache = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cache_dtype=self.kv_cache_dtype,
            sliding_window=model_config.uniform_sliding_window,
        )
        return EngineConfig(
            model_path=str(path),
            model=model_config,
            cache=cache,
            scheduler=scheduler,
            parallel=ParallelConfig(self.tensor_parallel_size, self.enable_expert_parallel),
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            attention_backend=attention_backend,
            load_format=self.load_format,
            tokenizer_path=self.tokenizer,
            reasoning_parser=self.reasoning_parser,
        )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


@dataclasses.dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the arguments of an AsyncLLM; the fields are EngineArgs'."""
