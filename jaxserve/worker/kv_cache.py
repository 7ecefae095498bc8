"""The paged KV cache's size and allocation: K and V, each [L * num_blocks, block_size, Hkv
(x replicas), hd] (layer l's block b at row l * num_blocks + b), sized at start-up from what
the weights left of the memory budget. With KV-cache groups (config/kv_groups.py) L is the
layout's slots per group: a block id is one block of that many layers, in whichever group
holds it.

A hybrid model (linear-attention layers: Qwen3-Next) keeps K and V for its full-attention
layers only (L = those), and beside them each linear layer's state in a fixed slot per
input-batch row (vLLM's hybrid cache groups: paged blocks for attention, a slot per request
for the rest): per linear layer, conv [N, K-1, C] in the model dtype and rec f32[N, Hv, Dk,
Dv], replicated, each its own array (a layer's scatter then updates its donated buffer in
place: slices of one stacked array were copied whole every step). Their bytes come off the
budget before the blocks are counted."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve import envs
from jaxserve.config import CacheConfig, ModelConfig, compat
from jaxserve.config.kv_groups import KVCacheLayout
from jaxserve.distributed.sharding import (
    kv_cache_sharding,
    splits_linear_attention,
    state_shardings,
)

logger = logging.getLogger(__name__)


class KVCacheSpec:
    def __init__(
        self,
        config: ModelConfig,
        mesh,
        block_size: int,
        kv_dtype: Any,
        num_cache_kv_heads: int,
        num_state_rows: int = 0,
        layout: KVCacheLayout | None = None,
        v_slots: tuple[int | None, ...] | None = None,
    ):
        """num_cache_kv_heads: the KV heads the cache holds (each replicated when tp > Hkv);
        num_state_rows: the input-batch rows (a hybrid model's state slots); layout: the
        KV-cache groups when there are several (CacheConfig.grouped_layout; None: one group
        of every cached layer); v_slots: each cached layer's V slot, None for a layer that
        keeps no V (ModelConfig.v_slots: GLM-5's shared-indexer layers), so V holds fewer
        slots than K (one group only; None: V has K's slots)."""
        self.config = config
        self.mesh = mesh
        self.block_size = block_size
        self.dtype = kv_dtype
        self.num_cache_kv_heads = num_cache_kv_heads
        self.num_state_rows = num_state_rows
        # layers of K/V one block id covers: a group's slots, or every cached layer
        self.num_slots = layout.num_slots if layout else len(config.kv_layers)
        self.num_groups = layout.num_groups if layout else 1
        if v_slots is not None and (layout is not None or len(v_slots) != self.num_slots):
            raise ValueError(f"v_slots {v_slots} need one group of {self.num_slots} slots")
        self.v_slots = v_slots
        self.num_v_slots = (
            self.num_slots
            if v_slots is None
            else 1 + max((v for v in v_slots if v is not None), default=-1)
        )
        self.sharding = kv_cache_sharding(mesh)
        if config.linear_attn is not None:  # (K, V, conv, rec)
            self.sharding = (self.sharding, self.sharding, *state_shardings(config, mesh))

    def bytes_per_block(self) -> int:
        """One block's K and V over all layers, on one device."""
        c = self.config
        kv_heads = self.num_cache_kv_heads // self.mesh.shape["tp"]
        itemsize = jnp.dtype(self.dtype).itemsize
        k_dim, v_dim = c.cache_dims
        per_token = self.num_slots * k_dim + self.num_v_slots * v_dim
        return self.block_size * kv_heads * per_token * itemsize

    def state_shapes(self) -> tuple:
        """A hybrid model's per-row states, (conv per linear layer, rec per linear layer);
        () for others."""
        la = self.config.linear_attn
        if la is None:
            return ()
        n, layers = self.num_state_rows, len(la.layers)
        conv = jax.ShapeDtypeStruct((n, la.conv_kernel - 1, la.conv_dim), self.config.dtype)
        rec = jax.ShapeDtypeStruct((n, la.num_v_heads, la.k_head_dim, la.v_head_dim), jnp.float32)
        return (conv,) * layers, (rec,) * layers

    def state_bytes(self) -> int:
        """The states' bytes on one device (split by key heads, or whole on each)."""
        leaves = jax.tree.leaves(self.state_shapes())
        total = sum(s.size * jnp.dtype(s.dtype).itemsize for s in leaves)
        split = splits_linear_attention(self.config, self.mesh.shape["tp"])
        return total // self.mesh.shape["tp"] if split else total

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block position's K and V over all cached layers, as KV connectors move it:
        [G * S, bs, H, kd + vd] (each KV-cache group's S slots of layers at that position's
        block of the group, config/kv_groups.py; each token's K columns then its V columns;
        MLA: its latent and rotary key, V empty or DSA's index key, zeros for a layer that
        keeps no V; H: the cache's heads, MLA's latent once per tensor-parallel rank)."""
        c = self.config
        if c.linear_attn is not None:
            raise ValueError(f"{c.architecture}: {compat.reason('KV connectors', 'hybrid models')}")
        layers = self.num_groups * self.num_slots
        return (layers, self.block_size, self.num_cache_kv_heads, sum(c.cache_dims))

    def allocate(self, num_blocks: int) -> tuple[jax.Array, ...]:
        """K and V of num_blocks blocks, zeros, in the cache's sharding (an MLA model's V
        holds nothing: its attention reads the values from K), and a hybrid model's states."""
        c = self.config
        rest = (self.block_size, self.num_cache_kv_heads)
        kv_sharding = kv_cache_sharding(self.mesh)

        def zeros(dim, slots=self.num_slots):
            shape = (slots * num_blocks, *rest, dim)
            return jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=kv_sharding)()

        def state(s, sharding):
            return jax.jit(lambda: jnp.zeros(s.shape, s.dtype), out_shardings=sharding)()

        conv, rec = self.state_shapes() or ((), ())
        states = ()
        if conv:
            states = (
                tuple(state(s, self.sharding[2]) for s in conv),
                tuple(state(s, self.sharding[3]) for s in rec),
            )
        if states:
            logger.info(
                "linear-attention states: %d rows, %.1f MiB (%d layers of conv %s, recurrent %s)",
                self.num_state_rows,
                self.state_bytes() / 2**20,
                len(states[0]),
                states[0][0].shape,
                states[1][0].shape,
            )

        k_dim, v_dim = c.cache_dims
        if c.mla is not None:
            logger.info(
                "MLA KV cache: %d values per token per layer (latent %d + rotary key %d), "
                "%d bytes per block of %d tokens on each device",
                k_dim,
                c.mla.kv_lora_rank,
                c.mla.qk_rope_head_dim,
                self.bytes_per_block(),
                self.block_size,
            )
        return (zeros(k_dim), zeros(v_dim, self.num_v_slots), *states)


def determine_num_blocks(
    cache_config: CacheConfig,
    device,
    bytes_per_block: int,
    min_blocks: int,
    max_model_len: int,
    reserved_bytes: int = 0,
) -> int:
    """Blocks that fit the budget on `device` after weights and compiled steps:
    num_gpu_blocks_override, else kv_cache_memory_bytes, else gpu_memory_utilization of the
    device's memory less what is in use, else JAXSERVE_CPU_KVCACHE_SPACE GiB. bytes_per_block: every
    cache one block id covers (a draft model's too); min_blocks: what one request of
    max_model_len needs, plus the null block; reserved_bytes: what else the budget must hold
    (a hybrid model's states)."""
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
    num_blocks = max(0, budget - reserved_bytes) // bytes_per_block
    if num_blocks < min_blocks:
        states = (
            f" after {reserved_bytes / 2**20:.0f} MiB of linear-attention states (one per "
            "max_num_seqs row: lower max_num_seqs to shrink them)"
            if reserved_bytes
            else ""
        )
        raise ValueError(
            f"KV cache budget of {budget / 2**20:.0f} MiB holds {num_blocks} blocks of "
            f"{cc.block_size} tokens{states}; max_model_len={max_model_len} needs "
            f"{min_blocks}. Raise kv_cache_memory_bytes / "
            "gpu_memory_utilization or lower max_model_len."
        )
    return int(num_blocks)
