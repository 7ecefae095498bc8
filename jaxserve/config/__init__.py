"""Frozen configuration dataclasses, by concern:

  model.py        ModelConfig (read from the HF config) and the dtype helpers
  rope.py         RopeConfig, the rotary embedding's parameters
  engine.py       CacheConfig, SchedulerConfig, ParallelConfig and EngineConfig, which holds them
  pooler.py       PoolerConfig (a pooling runner: embeddings)
  speculative.py  SpeculativeConfig (--speculative-config)
  kv_transfer.py  KVTransferConfig (--kv-transfer-config) and the KV connectors' names
  lora.py         LoRAConfig (--enable-lora and its limits)
  multimodal.py   MultiModalConfig (--limit-mm-per-prompt, --allowed-local-media-path)
  pipeline.py     pipeline parallelism's layer split (--pipeline-parallel-size)
  json_flag.py    json_object: a flag given as a dict or its JSON text
  compat.py       which optional features run together: the table every refused pair comes
                  from (docs/features.md is its grid)

The package imports nothing of jaxserve but `jaxserve.envs`: every layer may read a config.
`from jaxserve.config import EngineConfig` etc. work for every public name below.
"""

from jaxserve.config.engine import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from jaxserve.config.kv_transfer import (
    DEFAULT_KV_TRANSFER_ALLOWED_HOSTS,
    KV_CONNECTORS,
    KV_LOAD_FAILURE_POLICIES,
    KV_ROLES,
    KVTransferConfig,
)
from jaxserve.config.lora import LORA_ARCHITECTURES, LORA_DTYPES, LoRAConfig
from jaxserve.config.model import (
    ACTIVATIONS,
    QUANTIZATIONS,
    ModelConfig,
    RopeConfig,
    resolve_dtype,
)
from jaxserve.config.multimodal import DEFAULT_LIMIT_PER_PROMPT, MultiModalConfig
from jaxserve.config.pooler import POOLING_TYPES, PoolerConfig
from jaxserve.config.quantization import GROUPED_QUANT, checkpoint_quantization, int4_layout
from jaxserve.config.speculative import SPEC_METHODS, SpeculativeConfig

__all__ = [
    "LORA_ARCHITECTURES",
    "LORA_DTYPES",
    "LoRAConfig",
    "GROUPED_QUANT",
    "int4_layout",
    "ACTIVATIONS",
    "DEFAULT_KV_TRANSFER_ALLOWED_HOSTS",
    "DEFAULT_LIMIT_PER_PROMPT",
    "KV_CACHE_DTYPES",
    "KV_CONNECTORS",
    "KV_LOAD_FAILURE_POLICIES",
    "KV_ROLES",
    "POOLING_TYPES",
    "QUANTIZATIONS",
    "SPEC_METHODS",
    "CacheConfig",
    "EngineConfig",
    "KVTransferConfig",
    "MultiModalConfig",
    "ModelConfig",
    "ParallelConfig",
    "PoolerConfig",
    "RopeConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "checkpoint_quantization",
    "resolve_dtype",
]
