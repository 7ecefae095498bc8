"""Multi-head attention with GQA over a paged KV cache, and the metadata that drives it."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.layers.rotary import apply_rotary, rope_inv_freq
from pallas_kernels.paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

ATTENTION_BACKENDS = ("pallas", "reference")


class AttentionMetadata(NamedTuple):
    """Where a flat batch's tokens live in the paged KV cache (all int32, padded to buckets).

    slot_mapping:    [T] cache slot (block_id * block_size + offset) each new token's K/V is
                     written to; negative for padding tokens (nothing is written).
    block_tables:    [S, max_blocks] block ids of each sequence.
    kv_lens:         [S] tokens cached per sequence after this step's tokens are written.
    query_start_loc: [S+1] offsets of each sequence's tokens in the flat batch.
    num_seqs:        [1] sequences in use; later rows of the arrays above are padding.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array


def write_kv(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new: [T, Hkv, D] into cache: [num_blocks, block_size, Hkv, D] at slots: [T].

    Negative slots (padding) are dropped. With the cache donated this updates it in place.
    """
    num_blocks, block_size, hkv, d = cache.shape
    flat = cache.reshape(num_blocks * block_size, hkv, d)
    slots = jnp.where(slots >= 0, slots, num_blocks * block_size)  # out of range -> dropped
    return flat.at[slots].set(new.astype(cache.dtype), mode="drop").reshape(cache.shape)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    backend: str = "reference",
    mesh: Mesh | None = None,
) -> jax.Array:
    """q [T, Hq, D] over caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D].

    backend "reference" is the jnp op (XLA partitions it over `mesh` by itself); "pallas" is
    the kernel, compiled for a GPU and interpreted elsewhere, run per device over its own
    heads when the mesh splits them (shard_map: a custom call cannot be auto-partitioned).
    """
    args = (q, k_cache, v_cache, md.kv_lens, md.block_tables, md.query_start_loc, md.num_seqs)
    if backend == "reference":
        return ragged_paged_attention_reference(*args, sm_scale=sm_scale)
    on_gpu = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform == "gpu"
    kernel = functools.partial(ragged_paged_attention, sm_scale=sm_scale, interpret=not on_gpu)
    if mesh is None or mesh.shape[TP_AXIS] == 1:
        return kernel(*args)
    heads, cache = P(None, TP_AXIS, None), P(None, None, TP_AXIS, None)
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(heads, cache, cache, P(), P(), P(), P()),
        out_specs=heads,
        check_vma=False,
    )(*args)


def configure_attention(model: nnx.Module, backend: str, mesh: Mesh | None) -> None:
    """Make every Attention layer of `model` use `backend` (see `paged_attention`; checked by
    EngineArgs)."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Attention):
            module.backend, module.mesh = backend, mesh


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, hq, hkv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias

        def proj(eq, kernel_shape, bias_shape=None):
            return nnx.Einsum(
                eq, kernel_shape, bias_shape, dtype=config.dtype, param_dtype=config.dtype,
                rngs=rngs,
            )  # fmt: skip

        self.q_proj = proj("td,dnh->tnh", (d, hq, hd), (hq, hd) if bias else None)
        self.k_proj = proj("td,dnh->tnh", (d, hkv, hd), (hkv, hd) if bias else None)
        self.v_proj = proj("td,dnh->tnh", (d, hkv, hd), (hkv, hd) if bias else None)
        self.o_proj = proj("tnh,nhd->td", (hq, hd, d))
        self.rope = config.rope
        self.head_dim = hd
        self.backend, self.mesh = "reference", None  # configure_attention sets these

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [T, D], positions: [T], caches [num_blocks, block_size, Hkv, hd].

        Returns (out [T, D], k_cache, v_cache) with this step's K/V written.
        """
        inv_freq = rope_inv_freq(self.head_dim, self.rope)  # a trace-time constant
        q = apply_rotary(self.q_proj(x), positions, inv_freq)  # [T, Hq, hd]
        k = apply_rotary(self.k_proj(x), positions, inv_freq)  # [T, Hkv, hd]
        v = self.v_proj(x)  # [T, Hkv, hd]
        k_cache = write_kv(k_cache, k, md.slot_mapping)
        v_cache = write_kv(v_cache, v, md.slot_mapping)
        out = paged_attention(
            q, k_cache, v_cache, md, sm_scale=self.head_dim**-0.5, backend=self.backend,
            mesh=self.mesh,
        )  # fmt: skip
        return self.o_proj(out), k_cache, v_cache
