"""DeepSeek Sparse Attention's two halves over the paged cache: the lightning indexer's top-k
(each query's best-scored context tokens) and MLA's attention over those tokens alone.

`index_topk` scores a query's whole causal context by the index keys (kept in the MLA
layer's V cache, which MLA leaves empty) and keeps the best `topk` (XLA's top-k);
`sparse_mla_attention` turns those context indices into cache slots and attends to them
alone. Each half is a jnp reference (pallas_kernels/sparse_mla/reference.py; the attention's
a gather of the listed rows, its cost following the top-k, not the context) or, where
`$JAXSERVE_SPARSE_MLA_KERNEL=mosaic` asks and the call suits it, a Mosaic GPU kernel
(indexer.py: the scores page by page; mosaic.py: reads only the listed tokens' rows).
"""

from __future__ import annotations

import functools
import importlib
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve import envs
from jaxserve.distributed.mesh import TP_AXIS
from pallas_kernels.sparse_mla.reference import (
    index_logits_reference,
    sparse_mla_reference,
    token_slots,
)

logger = logging.getLogger(__name__)

SCORE_TILE = 16  # query rows whose gathered index keys are live at once
SPARSE_MLA_KERNELS = ("xla", "mosaic")


def query_sequences(md, num_tokens: int) -> jax.Array:
    """i32[T]: each query row's sequence (padding rows: the last)."""
    qsl, tables = md.query_start_loc, md.block_tables
    seq = jnp.searchsorted(qsl[1:], jnp.arange(num_tokens), side="right")
    return jnp.minimum(seq, tables.shape[0] - 1)


def index_topk(
    iq: jax.Array,
    iw: jax.Array,
    positions: jax.Array,
    index_cache: jax.Array,
    md,
    topk: int,
    *,
    backend: str = "reference",
    mesh: Mesh | None = None,
) -> jax.Array:
    """Each query's best-scored tokens of its causal context.

    iq f32[T, Hi, Di] index queries, iw f32[T, Hi] their weights, index_cache [N, bs, R, Di]
    (the first of R read). A token s's score for query t is sum_h relu(iq_th . k_s) iw_th
    (`index_logits_reference`, or the Mosaic GPU kernel: `_index_scores`). Returns
    i32[T, min(topk, context)]: context indices, best first (equal scores: the earlier
    token), -1 after a query's last visible token.
    """
    t = iq.shape[0]
    bs, tables = index_cache.shape[1], md.block_tables
    seq = query_sequences(md, t)
    ctx = tables.shape[1] * bs
    k = min(topk, ctx)
    pad = -t % SCORE_TILE

    scores = _index_scores(backend, iq, index_cache, mesh)

    def tile(i):
        rows = jnp.minimum(i * SCORE_TILE + jnp.arange(SCORE_TILE), t - 1)
        blocks = tables[seq[rows]]  # [Q, B]
        score = scores(iq[rows], iw[rows], index_cache, blocks, positions[rows])
        seen = jnp.arange(ctx)[None] < md.kv_lens[seq[rows]][:, None]  # (and <= position)
        best, chosen = lax.top_k(jnp.where(seen, score, -jnp.inf), k)
        return jnp.where(best > -jnp.inf, chosen, -1).astype(jnp.int32)

    chosen = lax.map(tile, jnp.arange((t + pad) // SCORE_TILE))
    return chosen.reshape(t + pad, k)[:t]


def sparse_mla_attention(
    query: jax.Array,
    chosen: jax.Array,
    k_cache: jax.Array,
    md,
    *,
    sm_scale: float,
    latent_dim: int,
    backend: str = "reference",
    mesh: Mesh | None = None,
) -> jax.Array:
    """query [T, H, r + rope] (absorbed), chosen i32[T, k] context indices (-1: none, after
    the others), k_cache [N, bs, R, r + rope] -> f32[T, H, r]. The kernel runs per device
    over its own heads and its own replica of the cache when the mesh splits them."""
    slots = token_slots(
        chosen, md.block_tables, query_sequences(md, query.shape[0]), k_cache.shape[1]
    )
    kernel = _kernel(backend, query, k_cache, latent_dim, mesh)
    if kernel is None:
        return sparse_mla_reference(query, k_cache, slots, sm_scale=sm_scale, latent_dim=latent_dim)
    kernel = functools.partial(kernel, sm_scale=sm_scale, latent_dim=latent_dim)
    if mesh is None or mesh.shape[TP_AXIS] == 1:
        return kernel(query, k_cache, slots)
    heads = P(None, TP_AXIS, None)
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(heads, P(None, None, TP_AXIS, None), P()),
        out_specs=heads,
        check_vma=False,
    )(query, k_cache, slots)


def _index_scores(backend: str, iq, cache, mesh):
    """The indexer's scores (iq, iw, cache, tables [Q, B], positions [Q]) -> f32[Q, B * bs]:
    the Mosaic GPU kernel when asked for and able (per device under tp: its replica of the
    cache; every device scores every query), else the jnp reference."""
    reason = mosaic_refusal(
        q_dtype=cache.dtype,
        cache_dtype=cache.dtype,
        head_dim=iq.shape[-1],
        device=_device(mesh),
        block_size=cache.shape[1],
        heads=iq.shape[1],
    )
    kernel = _mosaic(backend, "indexer", "index_logits", reason)
    if kernel is None:
        return index_logits_reference
    if mesh is None or mesh.shape[TP_AXIS] == 1:
        return kernel
    whole = P()
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(whole, whole, P(None, None, TP_AXIS, None), whole, whole),
        out_specs=whole,
        check_vma=False,
    )


def _kernel(backend: str, query, cache, latent_dim: int, mesh):
    """The Mosaic sparse-MLA kernel when asked for and able to serve the call, else None."""
    reason = mosaic_refusal(
        q_dtype=query.dtype,
        cache_dtype=cache.dtype,
        head_dim=query.shape[-1],
        device=_device(mesh),
        latent_dim=latent_dim,
    )
    return _mosaic(backend, "mosaic", "sparse_mla", reason)


def mosaic_refusal(
    *,
    q_dtype,
    cache_dtype,
    head_dim: int,
    device,
    latent_dim: int | None = None,
    block_size: int | None = None,
    heads: int | None = None,
) -> str | None:
    """Why a Mosaic GPU kernel of DeepSeek Sparse Attention cannot serve a call (None: it
    can): the sparse MLA's (latent_dim given) or the indexer's (block_size and heads)."""
    if device.platform != "gpu":
        return f"a {device.platform} device (it runs on NVIDIA GPUs)"
    capability = getattr(device, "compute_capability", None)
    if capability is not None and float(capability) < 9.0:
        return f"compute capability {capability} (TMA and wgmma need sm_90)"
    if q_dtype not in (jnp.bfloat16, jnp.float16) or cache_dtype != q_dtype:
        return f"q {q_dtype} over a {cache_dtype} cache (it takes bf16/f16 for both)"
    if head_dim % 64:
        return f"a head of {head_dim} (a multiple of 64)"
    if latent_dim is not None and latent_dim != 512:
        return f"latent_dim {latent_dim} (512)"
    if heads is not None and heads > 64:
        return f"{heads} index heads (at most 64)"
    if block_size is not None and (block_size & (block_size - 1) or not 8 <= block_size <= 256):
        return f"block size {block_size} (a power of two from 8 to 256)"
    return None


def _device(mesh):
    return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def _mosaic(backend: str, module: str, name: str, reason: str | None):
    """pallas_kernels.sparse_mla.<module>.<name> when $JAXSERVE_SPARSE_MLA_KERNEL=mosaic asks
    for it (not yet the default: no GPU has run it) and nothing refuses it, else None."""
    wanted = envs.JAXSERVE_SPARSE_MLA_KERNEL or "xla"
    if wanted not in SPARSE_MLA_KERNELS:
        raise ValueError(
            f"$JAXSERVE_SPARSE_MLA_KERNEL={wanted!r} is not one of {SPARSE_MLA_KERNELS}"
        )
    if backend != "pallas" or wanted != "mosaic":
        return None
    if reason is not None:
        _log_once(f"the Mosaic GPU {name} kernel cannot serve {reason}: the reference does")
        return None
    try:
        kernel = getattr(importlib.import_module(f"pallas_kernels.sparse_mla.{module}"), name)
    except ImportError as e:
        if not (e.name or "").startswith("jax"):
            raise
        _log_once(f"the Mosaic GPU {name} kernel needs {e.name}: the reference serves")
        return None
    return kernel


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)
