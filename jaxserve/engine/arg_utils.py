"""EngineArgs: the engine's keyword arguments (vLLM's names and defaults) -> EngineConfig.

`LLM(**kwargs)` and, later, `jaxserve serve --flags` both go through here, so a setting has one
name, one default and one validation wherever it is given.

The frontend imports this module to hold the arguments; `create_engine_config` runs where the
engine core runs (its process, engine/core_proc.py, or in-process), and only its checks that
need the model registry or the kernels import them, there.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax

from jaxserve.config import (
    DEFAULT_KV_TRANSFER_ALLOWED_HOSTS,
    LORA_ARCHITECTURES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    compat,
)
from jaxserve.config.kv_groups import kv_cache_layout
from jaxserve.config.pipeline import pp_layer_partition
from jaxserve.config.pooler import pooler_config_from
from jaxserve.config.speculative import mtp_architecture
from jaxserve.distributed.mesh import check_local_devices, validate_pipeline_layout
from jaxserve.transformers_utils.config import (
    check_generation_config,
    check_hf_overrides,
    read_model_config,
)
from jaxserve.transformers_utils.model_path import resolve_model_path, resolve_tokenizer_path
from jaxserve.transformers_utils.tokenizer import check_tokenizer_mode

logger = logging.getLogger(__name__)

# Without an accelerator every (tokens, seqs) bucket pair is compiled on a few CPU cores:
# smaller limits keep start-up short.
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS = 64, 1024
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 256, 8192


@dataclasses.dataclass
class EngineArgs:
    # A path, a hub id (ORG/NAME: the hub cache, downloaded when online; HF_HUB_OFFLINE=1:
    # the cache only), or None / "HuggingFaceTB/SmolLM2-135M-Instruct": the bundled default
    model: str | None = None
    tokenizer: str | None = None  # a HF tokenizer directory or hub id; default: the model's own
    # "auto" / "hf": the tokenizer's chat template; "deepseek_v32": DeepSeek-V3.2's encoding
    tokenizer_mode: str = "auto"
    revision: str | None = None  # the hub id's branch, tag or commit (default: main)
    tokenizer_revision: str | None = None  # the tokenizer's, when it is a hub id
    download_dir: str | None = None  # the hub cache to read and download into (default: HF's)
    load_format: str = "auto"  # "dummy": random weights (model: also a config.json or preset)
    # HF config fields set over the model's config.json (vLLM's --hf-overrides), e.g. fewer
    # layers or experts of a real model's shapes for a benchmark
    hf_overrides: dict | str | None = None
    tensor_parallel_size: int = 1
    # Pipeline stages, each its own layers (vLLM's split; config/pipeline.py), and up to this
    # many micro-batches in flight in the engine core
    pipeline_parallel_size: int = 1
    # Engine core processes, each with its own devices, scheduler and KV cache; new requests
    # go to the least loaded (engine/core_client.py::LoadBalancer)
    data_parallel_size: int = 1
    # Multi-host: one model's tensor_parallel_size devices spread over nnodes hosts, one
    # process each, joined by jax.distributed at master_addr:master_port (node_rank 0 runs the
    # scheduler and the API server; the others `jaxserve serve --headless`)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    enable_expert_parallel: bool = False  # MoE: whole experts per device instead of F slices
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int | None = None  # default: 256 (64 on CPU)
    max_num_batched_tokens: int | None = None  # default: 8192 (1024 on CPU)
    block_size: int = 16
    enable_prefix_caching: bool = True
    # One KV-cache group of every layer: a windowed layer keeps the whole context
    disable_hybrid_kv_cache_manager: bool = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # auto | bfloat16 | fp8 (e4m3) | fp8_e4m3 | fp8_e5m2
    max_logprobs: int = 20  # -1: the whole vocabulary (vLLM's); above it: the vocabulary
    scheduling_policy: str = "fcfs"
    # Schedule step N+1 while step N runs. Default: on with an accelerator; off on CPU, where
    # the "device" is the host's own cores and the overlap slows the step it runs beside
    # (benchmarks/results/cpu.md).
    async_scheduling: bool | None = None
    # Paged attention: "pallas" (the Pallas kernel; default on GPU) or "reference" (the jnp
    # op; default elsewhere, where the kernel only runs interpreted).
    attention_backend: str | None = None
    reasoning_parser: str | None = None  # e.g. deepseek_r1, qwen3 (jaxserve/reasoning)
    quantization: str | None = None  # int8 | fp8 (at load) | gguf | the checkpoint's method
    # "pooling": an embedding model (LLM.embed, /v1/embeddings) or a classifier (LLM.classify,
    # .score; a *ForSequenceClassification's "auto"), no generation; "auto" and "generate":
    # text generation. `task="embed"` (or classify, score) is vLLM's older runner="pooling".
    runner: str = "auto"
    task: str | None = None
    # {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} (or its JSON); default: the
    # model's sentence-transformers config, else LAST, normalised (vLLM's for decoders)
    pooler_config: dict | str | None = None
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": .., "prompt_lookup_max":
    # ..} (or its JSON): speculative decoding (ngram turns async scheduling off)
    speculative_config: dict | str | None = None
    # {"kv_connector": "ExampleConnector" | "ZmqConnector" | ..., "kv_role": "kv_producer" |
    # "kv_consumer" | "kv_both", ...} (or its JSON): disaggregated prefill / decode
    # (distributed/kv_transfer; docs/disaggregation.md)
    kv_transfer_config: dict | str | None = None
    # GiB of host memory for KV blocks evicted from the device (OffloadingConnector)
    kv_offloading_size: float | None = None
    # The hosts a request's kv_transfer_params may name as its KV's source (remote_host):
    # a consumer fetches from nowhere else. None: this machine only (127.0.0.1, ::1, localhost).
    kv_transfer_allowed_hosts: tuple[str, ...] | list[str] | None = None
    # Ready as soon as the step shapes that can serve any step are (token buckets 1, 4, 16, ..
    # and max_num_seqs', the greedy and all-pass samplers); the rest load or compile in the
    # background and are used once ready. Default off (`LLM`); on for `jaxserve serve`.
    background_compile: bool = False
    # LoRA adapters (vLLM's flags; config/lora.py): device slots, the rank they are padded to,
    # adapters kept on the host (default max_loras), the slots' dtype
    enable_lora: bool = False
    enable_prompt_embeds: bool = False  # prompts as embeddings (vLLM's --enable-prompt-embeds)
    # LLM.sleep() / wake_up() and the dev-mode /sleep route (engine/sleep.py, vLLM's flag)
    enable_sleep_mode: bool = False
    # OpenTelemetry: send a span per request to this OTLP endpoint (vLLM's flag; needs the
    # `otel` extra)
    otlp_traces_endpoint: str | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # Default sampling parameters (vLLM's): "auto", the model's generation_config.json; "vllm",
    # none; or a directory holding one. Its max_new_tokens caps every request's output.
    generation_config: str = "auto"
    # {"temperature": .., "top_p": .., "top_k": .., "min_p": .., "repetition_penalty": ..,
    # "max_new_tokens": ..} (or its JSON) over what generation_config gives
    override_generation_config: dict | str | None = None
    # Image inputs (vLLM's flags; config/multimodal.py): {"image": N} (or its JSON), the most
    # images one prompt may carry (default 999); the directory file:// image URLs may name;
    # the only hosts http(s) image URLs may name (None: any)
    limit_mm_per_prompt: dict | str | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None

    def tokenizer_source(self) -> str:
        """Where the frontend reads the tokenizer: --tokenizer, else the model (as the engine
        config's tokenizer_path / model_path resolve them)."""
        return str(self._tokenizer_path() or self.model_path())

    def model_path(self) -> Path:
        """The model's local path (a hub id's snapshot, downloaded if need be)."""
        return resolve_model_path(self.model, self.load_format, self.revision, self.download_dir)

    def _tokenizer_path(self) -> Path | None:
        if self.tokenizer is None:
            return None
        return resolve_tokenizer_path(self.tokenizer, self.tokenizer_revision, self.download_dir)

    def create_engine_config(self) -> EngineConfig:
        """Validate every argument (ValueError naming it) and build the frozen configs."""
        self._check_nodes()
        path = self.model_path()
        hf_overrides = check_hf_overrides(self.hf_overrides)
        check_tokenizer_mode(self.tokenizer_mode)
        model_config = read_model_config(
            path, self.dtype, self.quantization, hf_overrides, self.load_format
        )
        on_cpu = jax.default_backend() == "cpu"
        if self.enable_expert_parallel and not model_config.num_experts:
            raise ValueError(
                f"enable_expert_parallel: {model_config.architecture} is not a mixture of experts"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        spec = None
        if self.speculative_config is not None:
            spec = SpeculativeConfig.parse(self.speculative_config)
        kv_transfer = self._kv_transfer()
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            ngram = spec is not None and spec.method == "ngram"
            async_scheduling = not (on_cpu or ngram or self.pipeline_parallel_size > 1)
        pooler = pooler_config_from(
            self.runner, self.task, self.pooler_config, path, model_config.architecture
        )
        # every refusal of a pair of features, from config/compat.py's table
        compat.check(
            compat.active_features(
                self,
                model_config,
                speculative=spec,
                pooling=pooler is not None,
                async_scheduling=async_scheduling,
            )
        )
        speculative = None if spec is None else self._speculative(spec, model_config)
        scheduler = SchedulerConfig(
            max_model_len=_or(self.max_model_len, model_config.max_model_len),
            max_num_seqs=_or(self.max_num_seqs, CPU_MAX_NUM_SEQS if on_cpu else MAX_NUM_SEQS),
            max_num_batched_tokens=_or(
                self.max_num_batched_tokens,
                CPU_MAX_NUM_BATCHED_TOKENS if on_cpu else MAX_NUM_BATCHED_TOKENS,
            ),
            policy=self.scheduling_policy,
            async_scheduling=async_scheduling,
        )
        attention_backend = self._attention_backend()
        # pooling needs every prompt token's hidden state (MEAN): nothing may be skipped
        caching = self.enable_prefix_caching and pooler is None
        # a hybrid model's hits need its states kept at block boundaries: a slot per sequence
        hybrid = caching and model_config.linear_attn is not None
        cache = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=caching,
            state_cache_slots=scheduler.max_num_seqs if hybrid else 0,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cache_dtype=self.kv_cache_dtype,
            kv_layout=kv_cache_layout(
                model_config, self._one_kv_group(), self.tensor_parallel_size
            ),
        )
        parallel = ParallelConfig(
            self.tensor_parallel_size,
            self.enable_expert_parallel,
            self.data_parallel_size,
            self.nnodes,
            self.pipeline_parallel_size,
        )
        if (pp := parallel.pipeline_parallel_size) > 1:  # the split (or its override) fits
            pp_layer_partition(model_config.num_layers, pp)
            validate_pipeline_layout(parallel.tensor_parallel_size, pp, parallel.nnodes)
        check_local_devices(
            parallel.tensor_parallel_size, parallel.nnodes, parallel.pipeline_parallel_size
        )
        return EngineConfig(
            model_path=str(path),
            model=model_config,
            cache=cache,
            scheduler=scheduler,
            parallel=parallel,
            seed=self.seed,
            # vLLM's -1 (no cap) or a cap past the vocabulary: every token (top-K over V)
            max_logprobs=model_config.vocab_size
            if self.max_logprobs == -1
            else min(self.max_logprobs, model_config.vocab_size),
            attention_backend=attention_backend,
            load_format=self.load_format,
            hf_overrides=hf_overrides,
            tokenizer_path=None if self.tokenizer is None else str(self._tokenizer_path()),
            tokenizer_mode=self.tokenizer_mode,
            reasoning_parser=self.reasoning_parser,
            pooler=pooler,
            speculative=speculative,
            lora=self._lora(model_config),
            enable_prompt_embeds=self.enable_prompt_embeds,
            enable_sleep_mode=self.enable_sleep_mode,
            # every rank must have every shape when rank 0 picks one
            background_compile=self.background_compile and self.nnodes == 1,
            kv_transfer=kv_transfer,
            kv_transfer_allowed_hosts=self._kv_transfer_allowed_hosts(),
            generation_config=self.generation_config,
            override_generation_config=check_generation_config(
                self.generation_config, self.override_generation_config
            ),
            multimodal=MultiModalConfig.parse(
                self.limit_mm_per_prompt, self.allowed_local_media_path, self.allowed_media_domains
            ),
        )

    def _one_kv_group(self) -> str | None:
        """Why the KV cache keeps one group of every layer (config/kv_groups.py), or None."""
        if self.disable_hybrid_kv_cache_manager:
            return "--disable-hybrid-kv-cache-manager"
        if self.pipeline_parallel_size > 1:
            return "pipeline stages hold their own layers' blocks"
        return None

    def _lora(self, model_config) -> LoRAConfig | None:
        """--enable-lora's config; refused by name for the models it does not serve."""
        if not self.enable_lora:
            return None
        if model_config.architecture not in LORA_ARCHITECTURES or model_config.num_experts:
            raise ValueError(
                f"enable_lora: LoRA is not supported for {model_config.architecture}; it is "
                f"for the dense {', '.join(LORA_ARCHITECTURES)} models"
            )
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)

    def _attention_backend(self) -> str:
        """--attention-backend, or the platform's default; checked against what this
        process's jax and compiler can run (the kernels imported here, not by the frontend)."""
        from jaxserve.layers.attention import ATTENTION_BACKENDS, default_attention_backend
        from pallas_kernels.paged_attention import pallas_unavailable_message
        from pallas_kernels.paged_attention.cpu import cpu_kernel_unavailable_message

        attention_backend = self.attention_backend or default_attention_backend(
            jax.default_backend()
        )
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={attention_backend!r}; choose from {ATTENTION_BACKENDS}"
            )
        if attention_backend == "pallas" and pallas_unavailable_message():
            raise ImportError(pallas_unavailable_message())
        if attention_backend == "cpu":
            if jax.default_backend() != "cpu":
                raise ValueError(
                    f"attention_backend='cpu' runs on XLA:CPU, not {jax.default_backend()!r}"
                )
            if reason := cpu_kernel_unavailable_message():
                raise RuntimeError(f"{reason}; use --attention-backend reference")
        return attention_backend

    def _kv_transfer(self) -> KVTransferConfig | None:
        """--kv-transfer-config, or the OffloadingConnector --kv-offloading-size asks for."""
        if self.kv_offloading_size is not None:
            size = self.kv_offloading_size
            if not isinstance(size, int | float) or size <= 0:
                raise ValueError(
                    f"kv_offloading_size must be a positive number of GiB, got {size!r}"
                )
            if self.kv_transfer_config is not None:
                raise ValueError(
                    "kv_offloading_size with kv_transfer_config: one KV connector at a time "
                    "(no MultiConnector yet)"
                )
            return KVTransferConfig(
                "OffloadingConnector",
                kv_connector_extra_config={"cpu_bytes_to_use": int(size * 2**30)},
            )
        if self.kv_transfer_config is not None:
            return KVTransferConfig.parse(self.kv_transfer_config)
        return None

    def _kv_transfer_allowed_hosts(self) -> tuple[str, ...]:
        hosts = self.kv_transfer_allowed_hosts
        if hosts is None:
            return DEFAULT_KV_TRANSFER_ALLOWED_HOSTS
        if isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(
                f"kv_transfer_allowed_hosts must be a list of host names, got {hosts!r}"
            )
        return tuple(hosts)

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank={self.node_rank} is not a rank of nnodes={self.nnodes} (0 .. nnodes-1)"
            )

    def _speculative(self, spec: SpeculativeConfig, target) -> SpeculativeConfig:
        """The parsed speculative config with a draft model's path resolved and its
        vocabulary checked against the target's."""
        if spec.method == "ngram":
            return spec
        if spec.method == "mtp":  # the target's own MTP layers: no draft path to resolve
            mtp_architecture(target)  # ValueError naming a target without them
            return dataclasses.replace(spec, model=None)
        path = resolve_model_path(spec.model, "auto", download_dir=self.download_dir)
        draft = read_model_config(path, self.dtype, None)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config model {spec.model!r} has a vocabulary of "
                f"{draft.vocab_size} tokens; the target's has {target.vocab_size}"
            )
        if spec.method in ("eagle", "eagle3"):
            from jaxserve.models.interfaces import supports_eagle  # the core's side only
            from jaxserve.models.registry import get_model_class

            if not supports_eagle(get_model_class(target.architecture)):
                raise ValueError(
                    f"speculative_config method {spec.method} needs a target EAGLE heads draft "
                    f"for (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE, GLM-4.5, DeepSeek-V2/V3, "
                    f"gpt-oss); {target.architecture} is not one"
                )
            width = draft.hidden_size
            if spec.method == "eagle3":  # its fc reads the target's width
                width = getattr(draft.hf_config, "target_hidden_size", None) or width
            if width != target.hidden_size:
                raise ValueError(
                    f"speculative_config model {spec.model!r}: the EAGLE head's hidden_size "
                    f"{width} is not the target's {target.hidden_size}"
                )
        return dataclasses.replace(spec, model=str(path))


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


@dataclasses.dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the arguments of an AsyncLLM; the fields are EngineArgs'."""
