"""The paged KV cache's size and allocation: K and V, each [L * num_blocks, block_size, Hkv
(x replicas), hd] (layer l's block b at row l * num_blocks + b), sized at start-up from what
the weights left of the memory budget."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve import envs
from jaxserve.config import CacheConfig, ModelConfig
from jaxserve.distributed.sharding import kv_cache_sharding

logger = logging.getLogger(__name__)


class KVCacheSpec:
    def __init__(
        self, config: ModelConfig, mesh, block_size: int, kv_dtype: Any, num_cache_kv_heads: int
    ):
        """num_cache_kv_heads: the KV heads the cache holds (each replicated when tp > Hkv)."""
        self.config = config
        self.mesh = mesh
        self.block_size = block_size
        self.dtype = kv_dtype
        self.num_cache_kv_heads = num_cache_kv_heads
        self.sharding = kv_cache_sharding(mesh)

    def bytes_per_block(self) -> int:
        """One block's K and V over all layers, on one device."""
        c = self.config
        kv_heads = self.num_cache_kv_heads // self.mesh.shape["tp"]
        itemsize = jnp.dtype(self.dtype).itemsize
        return c.num_layers * self.block_size * kv_heads * sum(c.cache_dims) * itemsize

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's K and V over all layers, as KV connectors move it: [L, bs, H, kd + vd]
        (each token's K columns then its V columns; MLA: its latent and rotary key, V empty;
        H: the cache's heads, MLA's latent once per tensor-parallel rank)."""
        c = self.config
        return (c.num_layers, self.block_size, self.num_cache_kv_heads, sum(c.cache_dims))

    def allocate(self, num_blocks: int) -> tuple[jax.Array, jax.Array]:
        """K and V of num_blocks blocks, zeros, in the cache's sharding (an MLA model's V
        holds nothing: its attention reads the values from K)."""
        c = self.config
        rows = (c.num_layers * num_blocks, self.block_size, self.num_cache_kv_heads)

        def zeros(dim):
            return jax.jit(
                lambda: jnp.zeros((*rows, dim), self.dtype), out_shardings=self.sharding
            )()

        k_dim, v_dim = c.cache_dims
        if c.mla is not None:
            logger.info(
                "MLA KV cache: %d values per token per layer (latent %d + rotary key %d), "
                "%d bytes per block of %d tokens on each device", k_dim, c.mla.kv_lora_rank,
                c.mla.qk_rope_head_dim, self.bytes_per_block(), self.block_size,
            )  # fmt: skip
        return zeros(k_dim), zeros(v_dim)


def determine_num_blocks(
    cache_config: CacheConfig, device, bytes_per_block: int, min_blocks: int, max_model_len: int
) -> int:
    """Blocks that fit the budget on `device` after weights and compiled steps:
    num_gpu_blocks_override, else kv_cache_memory_bytes, else gpu_memory_utilization of the
    device's memory less what is in use, else JAXSERVE_CPU_KVCACHE_SPACE GiB. bytes_per_block: every
    cache one block id covers (a draft model's too); min_blocks: what one request of
    max_model_len needs, plus the null block."""
    cc = cache_config
    if cc.num_gpu_blocks_override is not None:
        return cc.num_gpu_blocks_override
    if cc.kv_cache_memory_bytes is not None:
        budget = cc.kv_cache_memory_bytes
    else:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            used = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
            budget = int(stats["bytes_limit"] * cc.gpu_memory_utilization) - used
        else:
            budget = int(envs.JAXSERVE_CPU_KVCACHE_SPACE * 2**30)
    num_blocks = budget // bytes_per_block
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV cache budget of {budget / 2**20:.0f} MiB holds {num_blocks} blocks of "
            f"{cc.block_size} tokens; max_model_len={max_model_len} needs "
            f"{min_blocks}. Raise kv_cache_memory_bytes / "
            "gpu_memory_utilization or lower max_model_len."
        )
    return int(num_blocks)
