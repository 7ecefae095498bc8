"""Frozen configuration dataclasses.

`ModelConfig` is the one place the HF config is read: everything downstream (layers, sharding,
KV cache sizing) reads these typed fields instead of poking at the HF object.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.distributed.mesh import devices_per_process

logger = logging.getLogger(__name__)

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
QUANTIZATIONS = ("int8", "fp8", "gguf")  # gguf: a GGUF file's blocks kept (layers/linear.py)
# --kv-cache-dtype values (vLLM's names) -> the cache's dtype; "auto": the model's dtype.
# "fp8" is e4m3, as vLLM has it on CUDA.
KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": jnp.bfloat16,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}

_DTYPES = {
    "float32": jnp.float32,
    "float": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "half": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_theta` + `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    # yarn: cos / sin scale (None: from factor, mscale, mscale_all_dim) and the ramp's bounds
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    SUPPORTED = ("default", "linear", "llama3", "yarn")

    @classmethod
    def from_hf(cls, hf_config: Any, layer_type: str | None = None) -> RopeConfig:
        """layer_type: the entry of per-layer-type rope_parameters (Gemma 3's
        full_attention / sliding_attention), when the config has them."""
        # transformers >= 5 folds rope_theta into `rope_parameters`; 4.x has both separately.
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        if params and all(isinstance(v, dict) for v in params.values()):
            params = dict(params.get(layer_type or "full_attention", {}))
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in cls.SUPPORTED:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(cls.SUPPORTED)}"
            )
        # As transformers standardises it: the config's own field first (Phi-3 keeps it
        # there), then the rope parameters, then max_position_embeddings.
        original = getattr(hf_config, "original_max_position_embeddings", None) or params.get(
            "original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", 8192)
        )
        optional = lambda key: None if params.get(key) is None else float(params[key])  # noqa: E731
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor") or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
            attention_factor=optional("attention_factor"),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=optional("mscale"),
            mscale_all_dim=optional("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only transformer, plus the dtype its weights live in."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None  # each token attends to the latest this many keys
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_pytorch_tanh
    # Per layer "sliding_attention" (sliding_window applies) or "full_attention"; None: every
    # layer alike (the window, if any, applies to all).
    layer_types: tuple[str, ...] | None = None
    sliding_rope: RopeConfig | None = None  # rotary of sliding layers, when it differs
    attn_logit_softcapping: float | None = None  # scores: cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits likewise (Gemma 2)
    query_pre_attn_scalar: float | None = None  # scores scaled by its ** -0.5, not head_dim's
    # Weight-only quantization of the decoder layers' linear kernels: "int8" or "fp8" (e4m3),
    # one float32 scale per output channel (layers/linear.py), computed at load, or read from
    # a pre-quantized checkpoint (prequantized: compressed-tensors, `checkpoint_quantization`).
    quantization: str | None = None
    prequantized: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE; layers/fused_moe.py): 0 experts = dense MLPs.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (Qwen3-MoE's)
    expert_parallel: bool = False  # experts split over the devices (load_model sets it)
    dtype: Any = jnp.float32
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(
        cls, hf_config: Any, dtype: str | Any = "auto", quantization: str | None = None
    ) -> ModelConfig:
        prequantized = checkpoint_quantization(hf_config)
        if quantization not in (None, *QUANTIZATIONS, "compressed-tensors"):
            raise ValueError(
                f"quantization {quantization!r} is not supported; choose from {QUANTIZATIONS}"
            )
        if prequantized and quantization not in (None, prequantized, "compressed-tensors"):
            raise ValueError(
                f"quantization {quantization!r} conflicts with the checkpoint's own "
                f"compressed-tensors {prequantized} weights"
            )
        if quantization == "compressed-tensors" and not prequantized:
            raise ValueError("quantization 'compressed-tensors': the checkpoint is not quantized")
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("HF config has no `architectures` entry; cannot pick a model class")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        rope_params = getattr(hf_config, "rope_parameters", None) or {}
        partial = rope_params.get("partial_rotary_factor", None)
        partial = getattr(hf_config, "partial_rotary_factor", None) if partial is None else partial
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
        hidden_act = (
            getattr(hf_config, "hidden_activation", None)
            or getattr(hf_config, "hidden_act", None)
            or "silu"
        )
        if hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        num_heads = hf_config.num_attention_heads
        # Qwen2 always has q/k/v biases; Llama-style configs say so with `attention_bias`.
        attention_bias = bool(getattr(hf_config, "attention_bias", False)) or archs[0].startswith(
            "Qwen2"
        )
        sliding_window = getattr(hf_config, "sliding_window", None)
        if archs[0].startswith("Qwen") and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types and not sliding_window:
            layer_types = None
        num_experts = int(
            getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", 0)
            or 0
        )  # fmt: skip
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        only_mlp = set(getattr(hf_config, "mlp_only_layers", None) or ())
        dense_layers = tuple(
            i for i in range(hf_config.num_hidden_layers)
            if num_experts and (i in only_mlp or (i + 1) % step)
        )  # fmt: skip
        sliding_rope = RopeConfig.from_hf(hf_config, "sliding_attention")
        if sliding_rope == RopeConfig.from_hf(hf_config):
            sliding_rope = None
        return cls(
            architecture=archs[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope=RopeConfig.from_hf(hf_config),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=sliding_window,
            qk_norm=archs[0].startswith(("Qwen3", "Gemma3")),
            hidden_act=hidden_act,
            layer_types=tuple(layer_types) if layer_types else None,
            sliding_rope=sliding_rope,
            attn_logit_softcapping=getattr(hf_config, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
            query_pre_attn_scalar=getattr(hf_config, "query_pre_attn_scalar", None),
            num_experts=num_experts,
            num_experts_per_tok=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(
                getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
            ),
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
            dense_layers=dense_layers,
            quantization=prequantized or quantization,
            prequantized=prequantized is not None,
            dtype=resolve_dtype(dtype, hf_config),
            hf_config=hf_config,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence the model takes (a sliding window is honoured by the attention,
        so it does not cap it)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: full attention)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.sliding_rope is not None and self.layer_window(layer) is not None:
            return self.sliding_rope
        return self.rope

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def uniform_sliding_window(self) -> int | None:
        """The sliding window when every layer has it (Mistral); None when any layer attends
        to the whole context (Gemma's global layers) or none has a window."""
        windows = {self.layer_window(layer) for layer in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The weights of a pre-quantized checkpoint (its config's quantization_config): "int8" or
    "fp8" for compressed-tensors with 8-bit symmetric per-channel or per-tensor weights stored
    unpacked (int-, naive- or float-quantized; W8A16, or W8A8 whose activations then stay in
    the model dtype); None for a full-precision checkpoint; ValueError naming anything else."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors":
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported (compressed-tensors 8-bit "
            "weights are; or load a full-precision checkpoint with --quantization int8|fp8)"
        )
    if fmt not in ("int-quantized", "naive-quantized", "float-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (unpacked 8-bit)")
    modes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        kind = (w.get("type"), w.get("num_bits"))
        if kind not in (("int", 8), ("float", 8)) or w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(
                f"compressed-tensors group {name!r}: {w.get('type')} {w.get('num_bits')}-bit "
                f"{w.get('strategy')} weights are not supported (8-bit, channel or tensor)"
            )
        if not w.get("symmetric", True):
            raise ValueError(f"compressed-tensors group {name!r}: asymmetric weights")
        modes.add("int8" if kind[0] == "int" else "fp8")
    if len(modes) != 1:
        raise ValueError(f"compressed-tensors weights of mixed kinds {sorted(modes)}")
    return modes.pop()


def resolve_dtype(dtype: str | Any, hf_config: Any = None) -> Any:
    """'auto' -> the checkpoint's dtype (bfloat16 when it names none) on accelerators, and
    float32 on CPU, where XLA's bf16 matmuls are slow and exact parity matters most."""
    if dtype != "auto":
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
            return _DTYPES[dtype]
        return jnp.dtype(dtype).type
    if jax.default_backend() == "cpu":
        return jnp.float32
    name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(name).removeprefix("torch.") if name is not None else "bfloat16"
    return _DTYPES.get(name, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, prefix caching, and how much memory it may take."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # explicit budget; wins over the utilisation
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + KV cache
    num_gpu_blocks_override: int | None = None  # exact block count (tests, debugging)
    cache_dtype: str = "auto"  # --kv-cache-dtype: a KV_CACHE_DTYPES key
    # The model's sliding window when every layer has one (ModelConfig.uniform_sliding_window):
    # blocks that fall out of it are given back as a request runs.
    sliding_window: int | None = None

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
    """How the model is spread over devices: tensor parallelism over one process's devices."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # a mixture of experts' experts split over the devices
    # Engines, each with its own tensor_parallel_size devices, scheduler and KV cache (not part
    # of an engine's executables: kept out of the config's repr, their cache key)
    data_parallel_size: int = dataclasses.field(default=1, repr=False)
    # Hosts one model spans (multi-host tensor parallelism, distributed/multihost.py): each
    # runs tensor_parallel_size / nnodes of the devices, one process per host
    nnodes: int = 1

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size < self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} cannot span nnodes="
                f"{self.nnodes}: every node needs at least one device"
            )
        if jax.process_count() != self.nnodes:
            raise ValueError(
                f"nnodes={self.nnodes} but {jax.process_count()} processes joined the JAX cluster"
            )
        available = jax.local_device_count()
        needed = devices_per_process(self.tensor_parallel_size, self.nnodes)[jax.process_index()]
        if needed > available:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size}"
                + (f" over nnodes={self.nnodes}" if self.nnodes > 1 else "")
                + f" needs {needed} devices here; there are {available} local "
                f"{jax.default_backend()} devices"
            )


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a pooling runner (`runner="pooling"`) turns a prompt's final hidden states into one
    vector: the last token's (LAST, vLLM's default for decoder models), their mean (MEAN) or
    the first token's (CLS), L2-normalised unless `normalize` is off (per request:
    PoolingParams.normalize)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type {self.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}"
            )


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`): a proposer drafts up to
    num_speculative_tokens tokens per request and step, the target model scores them in the
    next step and keeps the prefix its own sampling agrees with (spec_decode/).

    ngram (prompt lookup): the longest suffix of a request's tokens, between prompt_lookup_min
    and prompt_lookup_max tokens long, that occurred earlier in them; the tokens that followed
    its latest occurrence are the draft. Both unset: 5 and 5; one set: the other copies it.

    draft_model: `model` (an HF dir or .gguf of the target's vocabulary, resolved) drafts
    greedily with its own KV cache in the target's blocks (spec_decode/draft_model.py).

    eagle / eagle3: `model` is an EAGLE-1 / EAGLE-3 head (HF dir, models/eagle.py) for a
    Llama-family target; it drafts greedily from the target's hidden states
    (spec_decode/eagle.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model / eagle / eagle3: the draft's path

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported; jaxserve "
                f"implements {', '.join(SPEC_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}"
            )
        if self.method in ("draft_model", "eagle", "eagle3"):
            if not self.model:
                raise ValueError(f"speculative_config method {self.method} needs a model")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config prompt_lookup_min/max are for method ngram")
            return
        if self.model is not None:
            raise ValueError(f"speculative_config model {self.model!r}: method ngram takes none")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {n!r}")
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, config: dict | str) -> SpeculativeConfig:
        """From `--speculative-config` JSON or its dict (vLLM's field names)."""
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config {config!r} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {config!r}")
        config = dict(config)
        method = config.pop("method", None)
        if config.get("model") == "ngram":  # vLLM's older spelling of method ngram
            del config["model"]
            method = method or "ngram"
        elif method is None and config.get("model"):
            method = "draft_model"  # vLLM refines this to eagle etc. from the checkpoint
        if method is None:
            raise ValueError(
                f"speculative_config {config!r} names no method; jaxserve implements "
                f"{', '.join(SPEC_METHODS)}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        unknown = sorted(set(config) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported fields {unknown}")
        return cls(method=method, **config)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (`--kv-transfer-config`, vLLM's fields; distributed/kv_transfer/):
    kv_producer instances save the KV of the prompts they compute, kv_consumer instances load
    KV instead of recomputing it, kv_both do both. kv_ip / kv_port: where a direct connector's
    producer serves its blocks (port + the engine's data-parallel index). kv_buffer_size:
    bytes of KV a producer keeps for its consumers. kv_load_failure_policy: what a request
    does when its KV cannot be loaded (the producer died, a timeout): recompute it, or fail.
    --kv-offloading-size makes one of connector OffloadingConnector
    (kv_connector_extra_config {"cpu_bytes_to_use": N})."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        from jaxserve.distributed.kv_transfer import CONNECTORS  # the registry (lazy: no cycle)

        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"kv_transfer_config kv_connector {self.kv_connector!r} is not supported; "
                f"jaxserve implements {', '.join(CONNECTORS)}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config kv_role {self.kv_role!r} must be one of {', '.join(KV_ROLES)}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config kv_load_failure_policy {self.kv_load_failure_policy!r} "
                f"must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_transfer_config kv_connector_extra_config must be an object, got "
                f"{self.kv_connector_extra_config!r}"
            )
        if not 0 < int(self.kv_port) < 65536:
            raise ValueError(f"kv_transfer_config kv_port {self.kv_port!r} is not a port")

    @classmethod
    def parse(cls, config: dict | str) -> KVTransferConfig:
        """From a dict or its JSON (the CLI's string); vLLM fields jaxserve has no use for
        (kv_rank, kv_parallel_size, kv_buffer_device, kv_connector_module_path) are accepted
        and ignored with a warning, unknown ones are an error."""
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
        if not isinstance(config, dict) or "kv_connector" not in config:
            raise ValueError(f"kv_transfer_config needs a kv_connector, got {config!r}")
        config = dict(config)
        ignored = {"kv_rank", "kv_parallel_size", "kv_buffer_device", "kv_connector_module_path"}
        for name in ignored & config.keys():
            logger.warning("kv_transfer_config: %s is not used by jaxserve", name)
            config.pop(name)
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(config.keys() - fields):
            raise ValueError(f"kv_transfer_config: unknown fields {unknown}")
        return cls(**config)


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
    tokenizer_path: str | None = None  # default: model_path (structured outputs read it)
    reasoning_parser: str | None = None  # structured outputs bind after the reasoning ends
    pooler: PoolerConfig | None = None  # set: a pooling runner (embeddings), no generation
    speculative: SpeculativeConfig | None = None
    # Ready once the step shapes that can serve any step are; the rest in the background
    # (ModelRunner.compile_all). Not part of what the executables depend on: no repr.
    background_compile: bool = dataclasses.field(default=False, compare=False, repr=False)
    # A KV connector (distributed/kv_transfer); its block copies are compiled beside the steps.
    kv_transfer: KVTransferConfig | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}")
        if self.scheduler.max_model_len > self.model.max_model_len:
            raise ValueError(
                f"max_model_len={self.scheduler.max_model_len} exceeds the model's "
                f"{self.model.max_model_len}"
            )
