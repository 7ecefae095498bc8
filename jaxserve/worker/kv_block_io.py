"""Copies of whole KV blocks between the paged KV cache and the host, for KV connectors
(distributed/kv_transfer): one compiled gather and one scatter per block-count bucket
(powers of two up to MAX_BLOCKS_PER_COPY; larger copies run in chunks), compiled with the
step executables so a copy never compiles while serving.

The cache is K and V of [L * num_blocks, block_size, Hkv, hd] each (layer l's block b at row
l * num_blocks + b); a block travels as [2, L, block_size, Hkv, hd]. Padding ids are the null
block 0: a gather reads it for nothing, a scatter writes zeros into it (nothing reads it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.distributed.sharding import put
from jaxserve.worker.buckets import bucket

MAX_BLOCKS_PER_COPY = 32


def gather_blocks(kv_caches, block_ids: jax.Array, *, num_layers: int):
    """kv_caches: (K, V) [L * N, bs, H, hd]; block_ids i32[n] -> [n, 2, L, bs, H, hd]."""
    out = []
    for cache in kv_caches:
        per_layer = cache.reshape(num_layers, -1, *cache.shape[1:])  # [L, N, bs, H, hd]
        out.append(per_layer[:, block_ids])  # [L, n, bs, H, hd]
    return jnp.stack(out).transpose(2, 0, 1, 3, 4, 5)


def scatter_blocks(kv_caches, block_ids: jax.Array, blocks: jax.Array, *, num_layers: int):
    """Write blocks [n, 2, L, bs, H, hd] at block_ids i32[n]; returns the new (K, V)."""
    out = []
    for i, cache in enumerate(kv_caches):
        per_layer = cache.reshape(num_layers, -1, *cache.shape[1:])
        per_layer = per_layer.at[:, block_ids].set(blocks[:, i].swapaxes(0, 1).astype(cache.dtype))
        out.append(per_layer.reshape(cache.shape))
    return tuple(out)


def copy_buckets(max_blocks_per_req: int) -> list[int]:
    """Block counts a copy is padded to: 1, 2, 4, ... up to MAX_BLOCKS_PER_COPY."""
    top = min(MAX_BLOCKS_PER_COPY, 1 << max(max_blocks_per_req - 1, 0).bit_length())
    buckets, b = [], 1
    while b <= top:
        buckets.append(b)
        b *= 2
    return buckets


def chunks(block_ids: list[int], buckets: list[int]) -> list[tuple[np.ndarray, int, int]]:
    """Split block_ids into copies: (ids padded to a bucket with 0, offset, real count)."""
    out = []
    for start in range(0, len(block_ids), buckets[-1]):
        part = block_ids[start : start + buckets[-1]]
        n = bucket(buckets, len(part))
        ids = np.zeros(n, np.int32)
        ids[: len(part)] = part
        out.append((ids, start, len(part)))
    return out


class KVBlockCopier:
    """A KV connector's block copies for one runner: a jitted gather and scatter per
    block-count bucket, lowered with the step executables (`lowerings`) and run from the
    registry while serving."""

    def __init__(self, spec, max_blocks_per_req: int):
        """spec: the runner's KVCacheSpec (worker/kv_cache.py)."""
        self.spec = spec
        self.buckets = copy_buckets(max_blocks_per_req)
        n_layers = spec.config.num_layers
        self._gather = jax.jit(functools.partial(gather_blocks, num_layers=n_layers))
        self._scatter = jax.jit(
            functools.partial(scatter_blocks, num_layers=n_layers),
            donate_argnums=(0,), out_shardings=(spec.sharding,) * 2,
        )  # fmt: skip
        self.blocks_sharding = NamedSharding(spec.mesh, P(None, None, None, None, TP_AXIS))

    def lowerings(self, kv) -> dict[tuple, Callable[[], Any]]:
        """kv: the cache's (K, V) as ShapeDtypeStructs."""
        out: dict[tuple, Callable[[], Any]] = {}
        for n in self.buckets:
            ids = np.zeros(n, np.int32)
            blocks = jax.ShapeDtypeStruct(
                (n, *self.spec.block_shape), self.spec.dtype, sharding=self.blocks_sharding
            )
            out["kv_gather", n] = functools.partial(self._gather.lower, kv, ids)
            out["kv_scatter", n] = functools.partial(self._scatter.lower, kv, ids, blocks)
        return out

    def load(self, executables, kv_caches, loads: list[tuple[int, np.ndarray]]):
        """Scatter host blocks (block id, [2, L, bs, H, hd]) into the cache (before the step's
        forward reads them); returns the new (K, V)."""
        block_ids = [b for b, _ in loads]
        for ids, start, n in chunks(block_ids, self.buckets):
            data = np.zeros((len(ids), *self.spec.block_shape), self.spec.dtype)
            data[:n] = np.stack([blk for _, blk in loads[start : start + n]])
            kv_caches = executables["kv_scatter", len(ids)](
                kv_caches, ids, put(data, self.blocks_sharding)
            )
        return kv_caches

    def gather(self, executables, kv_caches, block_ids: list[int]) -> list[tuple[jax.Array, int]]:
        """Start copying blocks out of the cache: (device array, real count) per chunk."""
        out = []
        for ids, _, n in chunks(block_ids, self.buckets):
            blocks = executables["kv_gather", len(ids)](kv_caches, ids)
            blocks.copy_to_host_async()
            out.append((blocks, n))
        return out
