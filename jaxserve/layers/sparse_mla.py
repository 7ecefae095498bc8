"""DeepSeek Sparse Attention's two halves over the paged cache: the lightning indexer's top-k
(each query's best-scored context tokens) and MLA's attention over those tokens alone.

`index_topk` scores a query's whole causal context by the index keys (kept in the MLA
layer's V cache, which MLA leaves empty) and keeps the best `topk`; `sparse_mla_attention`
turns those context indices into cache slots and attends to them: the Mosaic GPU kernel
(pallas_kernels/sparse_mla/mosaic.py: it reads only the listed tokens' latents) where
`$JAXSERVE_SPARSE_MLA_KERNEL=mosaic` asks for it and it can serve the call, else the jnp
reference (a gather of the listed tokens, then dense math: its cost follows the top-k, not
the context).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve import envs
from jaxserve.distributed.mesh import TP_AXIS
from pallas_kernels.sparse_mla.reference import sparse_mla_reference, token_slots

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
) -> jax.Array:
    """Each query's best-scored tokens of its causal context.

    iq f32[T, Hi, Di] index queries, iw f32[T, Hi] their weights, index_cache [N, bs, R, Di]
    (the first of R read). A token s's score for query t is sum_h relu(iq_th . k_s) iw_th.
    Returns i32[T, min(topk, context)]: context indices, best first (equal scores: the
    earlier token), -1 after a query's last visible token.
    """
    t = iq.shape[0]
    bs, tables = index_cache.shape[1], md.block_tables
    seq = query_sequences(md, t)
    ctx = tables.shape[1] * bs
    k = min(topk, ctx)
    pad = -t % SCORE_TILE

    def tile(i):
        rows = jnp.minimum(i * SCORE_TILE + jnp.arange(SCORE_TILE), t - 1)
        blocks = tables[seq[rows]]  # [Q, B]
        keys = index_cache[blocks, :, 0].reshape(SCORE_TILE, ctx, -1).astype(jnp.float32)
        at = jnp.arange(ctx)
        valid = (at[None] <= positions[rows][:, None]) & (at[None] < md.kv_lens[seq[rows]][:, None])
        score = jnp.einsum("qhd,qkd->qhk", iq[rows], keys)
        score = jnp.einsum("qhk,qh->qk", jax.nn.relu(score), iw[rows])
        best, chosen = lax.top_k(jnp.where(valid, score, -jnp.inf), k)
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


def mosaic_refusal(*, q_dtype, cache_dtype, head_dim: int, latent_dim: int, device) -> str | None:
    """Why the Mosaic GPU sparse-MLA kernel cannot serve a call (None: it can)."""
    if device.platform != "gpu":
        return f"a {device.platform} device (it runs on NVIDIA GPUs)"
    capability = getattr(device, "compute_capability", None)
    if capability is not None and float(capability) < 9.0:
        return f"compute capability {capability} (TMA and wgmma need sm_90)"
    if q_dtype not in (jnp.bfloat16, jnp.float16) or cache_dtype != q_dtype:
        return f"q {q_dtype} over a {cache_dtype} cache (it takes bf16/f16 for both)"
    if latent_dim != 512 or head_dim % 64:
        return f"latent_dim {latent_dim}, head {head_dim} (512, and a multiple of 64)"
    return None


def _kernel(backend: str, query, cache, latent_dim: int, mesh):
    """The Mosaic kernel when asked for ($JAXSERVE_SPARSE_MLA_KERNEL=mosaic) and able to
    serve the call, else None (the reference). Not yet the default: no GPU has run it."""
    wanted = envs.JAXSERVE_SPARSE_MLA_KERNEL or "xla"
    if wanted not in SPARSE_MLA_KERNELS:
        raise ValueError(
            f"$JAXSERVE_SPARSE_MLA_KERNEL={wanted!r} is not one of {SPARSE_MLA_KERNELS}"
        )
    if backend != "pallas" or wanted != "mosaic":
        return None
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    reason = mosaic_refusal(
        q_dtype=query.dtype,
        cache_dtype=cache.dtype,
        head_dim=query.shape[-1],
        latent_dim=latent_dim,
        device=device,
    )
    if reason is not None:
        _log_once(f"the Mosaic GPU sparse-MLA kernel cannot serve {reason}: the reference does")
        return None
    try:
        from pallas_kernels.sparse_mla.mosaic import sparse_mla
    except ImportError as e:
        if not (e.name or "").startswith("jax"):
            raise
        _log_once(f"the Mosaic GPU sparse-MLA kernel needs {e.name}: the reference serves")
        return None
    return sparse_mla


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)
