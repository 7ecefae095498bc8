"""How many long sequences a KV budget holds, from the allocator alone (no weights, no device).

The model's KV-cache layout (config/kv_groups.py) gives the bytes of one block id (its
slots of layers, each block_size tokens of K and V on one device); the budget then holds
budget // bytes blocks. Sequences of seq_len tokens are admitted one after another into a
`KVCacheManager` of that many blocks as the scheduler runs them: the prompt in chunks of
`chunk` tokens (a windowed group holds its window and the chunk being written), then one
decode step (the windowed groups give back what fell out of their window), until one no
longer fits. One group of every layer (`--disable-hybrid-kv-cache-manager`, jaxserve before
groups) is the "before" of each model.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.config.kv_groups import KVCacheLayout, kv_cache_layout
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.distributed.sharding import kv_head_replicas
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Capacity:
    layout: str  # KVCacheLayout.describe()
    block_bytes: int  # one block id's K and V on one device
    num_blocks: int  # what the budget holds
    sequences: int  # seq_len-token sequences that fit at once


def block_bytes(config: ModelConfig, layout: KVCacheLayout, block_size: int, dtype) -> int:
    """One block id's K and V (layout.num_slots layers of block_size tokens; V of fewer where
    some layers keep none, ModelConfig.v_slots), tp 1 (the cache's heads: Gemma 4's rows fit
    its widest layer, distributed/sharding.py)."""
    heads = config.num_kv_heads * kv_head_replicas(config, 1)
    k_dim, v_dim = config.cache_dims
    v_slots = layout.num_slots
    if config.v_slots is not None and layout.num_groups == 1:  # GLM-5's shared-indexer layers
        v_slots = sum(v is not None for v in config.v_slots)
    per_block = layout.num_slots * k_dim + v_slots * v_dim
    return block_size * heads * per_block * jnp.dtype(dtype).itemsize


def capacity(
    config: ModelConfig,
    budget_bytes: int,
    seq_len: int,
    *,
    block_size: int = 16,
    chunk: int = 8192,
    one_group: bool = False,
    dtype=jnp.bfloat16,
) -> Capacity:
    """Sequences of seq_len tokens that fit budget_bytes of KV cache (module docstring)."""
    layout = kv_cache_layout(config, "the before case" if one_group else None)
    size = block_bytes(config, layout, block_size, dtype)
    num_blocks = budget_bytes // size
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False, groups=layout.groups)
    n = 0
    while True:
        request = Request(
            str(n), [1] * seq_len, SamplingParams(), eos_token_id=None, block_size=block_size
        )
        for start in range(0, seq_len, chunk):
            request.num_computed_tokens = start
            if kv.allocate_slots(request, min(chunk, seq_len - start)) is None:
                kv.check_no_leaks()
                return Capacity(layout.describe(), size, num_blocks, n)
        request.num_computed_tokens = seq_len
        request.append_output_token_ids(1)
        if kv.allocate_slots(request, 1) is None:  # its first decode step
            return Capacity(layout.describe(), size, num_blocks, n)
        n += 1
