"""Copies of whole KV blocks between the paged KV cache and the host, for KV connectors
(distributed/kv_transfer): one compiled gather and one scatter per block-count bucket
(powers of two up to MAX_BLOCKS_PER_COPY; larger copies run in chunks), compiled with the
step executables so a copy never compiles while serving.

The cache is K [L * num_blocks, block_size, Hkv, kd] and V [.., vd] (layer l's block b at row
l * num_blocks + b; kd = vd = head_dim, or MLA's latent and rotary key in K, V empty); a block
travels as [L, block_size, Hkv, kd + vd], each token's K columns then its V columns. Padding
ids are the null block 0: a gather reads it for nothing, a scatter writes zeros into it
(nothing reads it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.distributed.sharding import put
from jaxserve.worker.buckets import bucket
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_feature import LoweringInputs, StepFeature
from jaxserve.worker.step_types import StepBatch

MAX_BLOCKS_PER_COPY = 32


def _per_slot(cache: jax.Array, num_slots: int) -> jax.Array:
    """[S * N, bs, H, d] -> [S, N, bs, H, d] (d may be 0: MLA's V)."""
    return cache.reshape(num_slots, cache.shape[0] // num_slots, *cache.shape[1:])


def gather_blocks(kv_caches, block_ids: jax.Array, *, num_slots: int, v_slots=None):
    """kv_caches: K [S * N, bs, H, kd], V [.., vd] (or [S_v * N, ..] with v_slots: each K
    slot's V slot or None, whose V travels as zeros); block_ids i32[n, G] (each position's
    block in each KV-cache group) -> [n, G * S, bs, H, kd + vd]."""
    out = []
    for i, cache in enumerate(kv_caches):
        slots = v_slots if i == 1 else None
        per_slot = _per_slot(cache, num_slots if slots is None else _count(slots))
        groups = [_expand(per_slot[:, block_ids[:, g]], slots) for g in range(block_ids.shape[1])]
        out.append(jnp.concatenate(groups, axis=0))  # [G * S, n, bs, H, d]
    return jnp.concatenate(out, axis=-1).swapaxes(0, 1)


def scatter_blocks(
    kv_caches, block_ids: jax.Array, blocks: jax.Array, *, num_slots: int, v_slots=None
):
    """Write blocks [n, G * S, bs, H, kd + vd] at block_ids i32[n, G] (the V of a slot that
    keeps none is dropped); returns the new (K, V)."""
    out, start = [], 0
    for i, cache in enumerate(kv_caches):
        slots = v_slots if i == 1 else None
        part = blocks[..., start : start + cache.shape[-1]].swapaxes(0, 1)  # [G * S, n, ...]
        start += cache.shape[-1]
        per_slot = _per_slot(cache, num_slots if slots is None else _count(slots))
        for g in range(block_ids.shape[1]):
            rows = part[g * num_slots : (g + 1) * num_slots]
            if slots is not None:
                rows = rows[jnp.asarray([k for k, v in enumerate(slots) if v is not None])]
            per_slot = per_slot.at[:, block_ids[:, g]].set(rows.astype(cache.dtype))
        out.append(per_slot.reshape(cache.shape))
    return tuple(out)


def _count(v_slots) -> int:
    return sum(v is not None for v in v_slots)


def _expand(rows: jax.Array, v_slots) -> jax.Array:
    """[S_v, n, ...] -> [S, n, ...]: each slot's V rows, zeros for a slot that keeps none."""
    if v_slots is None:
        return rows
    zero = jnp.zeros((1, *rows.shape[1:]), rows.dtype)
    padded = jnp.concatenate([rows, zero])
    return padded[jnp.asarray([len(rows) if v is None else v for v in v_slots])]


def copy_buckets(max_blocks_per_req: int) -> list[int]:
    """Block counts a copy is padded to: 1, 2, 4, ... up to MAX_BLOCKS_PER_COPY."""
    top = min(MAX_BLOCKS_PER_COPY, 1 << max(max_blocks_per_req - 1, 0).bit_length())
    buckets, b = [], 1
    while b <= top:
        buckets.append(b)
        b *= 2
    return buckets


def chunks(
    block_ids: list, buckets: list[int], num_groups: int = 1
) -> list[tuple[np.ndarray, int, int]]:
    """Split block_ids (per block position: its id, or a tuple of each KV-cache group's) into
    copies: (ids i32[bucket, G] padded with 0, offset, real count)."""
    out = []
    for start in range(0, len(block_ids), buckets[-1]):
        part = block_ids[start : start + buckets[-1]]
        n = bucket(buckets, len(part))
        ids = np.zeros((n, num_groups), np.int32)
        ids[: len(part)] = np.asarray(part, np.int32).reshape(len(part), num_groups)
        out.append((ids, start, len(part)))
    return out


class KVBlockCopier(StepFeature):
    """A KV connector's block copies for one runner: a jitted gather and scatter per
    block-count bucket, lowered with the step executables (`lowerings`) and run from the
    registry while serving: a step's loads scattered before its forward, its saves gathered
    after it and handed to the connector when the step is fetched."""

    name = "kv_saves"

    def __init__(self, spec, max_blocks_per_req: int):
        """spec: the runner's KVCacheSpec (worker/kv_cache.py)."""
        self.spec = spec
        self.connector: Any = None  # distributed/kv_transfer's (ModelRunner.set_kv_connector)
        self.buckets = copy_buckets(max_blocks_per_req)
        self.num_groups = spec.num_groups
        slots = dict(num_slots=spec.num_slots, v_slots=spec.v_slots)
        self._gather = jax.jit(functools.partial(gather_blocks, **slots))
        self._scatter = jax.jit(
            functools.partial(scatter_blocks, **slots),
            donate_argnums=(0,),
            out_shardings=(spec.sharding,) * 2,
        )
        self.blocks_sharding = NamedSharding(spec.mesh, P(None, None, None, TP_AXIS))

    def cache_key(self) -> dict[str, str]:
        return {"kv_copies": repr(self.buckets)}  # their own file: a start without stays warm

    def lowerings(self, inputs: LoweringInputs) -> dict[tuple, Callable[[], Any]]:
        kv = inputs.kv
        out: dict[tuple, Callable[[], Any]] = {}
        for n in self.buckets:
            ids = np.zeros((n, self.num_groups), np.int32)
            blocks = jax.ShapeDtypeStruct(
                (n, *self.spec.block_shape), self.spec.dtype, sharding=self.blocks_sharding
            )
            out["kv_gather", n] = functools.partial(self._gather.lower, kv, ids)
            out["kv_scatter", n] = functools.partial(self._scatter.lower, kv, ids, blocks)
        return out

    # ------------------------------------------------------------------ a serving step
    def load(self, so: SchedulerOutput, kv_caches: Any, executables) -> Any:
        meta = so.kv_connector_metadata
        if meta is None or not meta.loads:
            return kv_caches
        kv_caches = self.scatter(executables, kv_caches, meta.loads)
        self.connector.note_loaded(len(meta.loads))
        return kv_caches

    def after_forward(
        self, so: SchedulerOutput, batch: StepBatch, hidden: jax.Array, kv_caches, executables
    ) -> Any:
        """The saved blocks, read before the next step overwrites them: (hashes, chunks)."""
        meta = so.kv_connector_metadata
        if meta is None or not meta.saves:
            return None
        blocks = self.gather(executables, kv_caches, [b for b, _ in meta.saves])
        return [h for _, h in meta.saves], blocks

    def finish(
        self, batch: StepBatch, value: Any, ib: InputBatch, result: ModelRunnerOutput
    ) -> None:
        """Saved before the step's outputs leave the engine."""
        if value is not None:
            hashes, chunks = value
            self.connector.save_blocks(hashes, np.concatenate([b[:n] for b, n in chunks]))

    def scatter(self, executables, kv_caches, loads: list[tuple[Any, np.ndarray]]):
        """Scatter host blocks (block id or ids, [G * S, bs, H, kd + vd]) into the cache
        (before the step's forward reads them); returns the new (K, V)."""
        block_ids = [b for b, _ in loads]
        for ids, start, n in chunks(block_ids, self.buckets, self.num_groups):
            data = np.zeros((len(ids), *self.spec.block_shape), self.spec.dtype)
            data[:n] = np.stack([blk for _, blk in loads[start : start + n]])
            kv_caches = executables["kv_scatter", len(ids)](
                kv_caches, ids, put(data, self.blocks_sharding)
            )
        return kv_caches

    def gather(self, executables, kv_caches, block_ids: list) -> list[tuple[jax.Array, int]]:
        """Start copying blocks out of the cache: (device array, real count) per chunk."""
        out = []
        for ids, _, n in chunks(block_ids, self.buckets, self.num_groups):
            blocks = executables["kv_gather", len(ids)](kv_caches, ids)
            blocks.copy_to_host_async()
            out.append((blocks, n))
        return out
