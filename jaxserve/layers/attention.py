"""Multi-head attention with GQA over a paged KV cache, and the metadata that drives it."""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.config.kv_groups import KVCacheLayout
from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.layers.linear import Linear
from jaxserve.layers.lora import LoRABatch
from jaxserve.layers.norm import HeadsRMSNorm, RMSNorm, rms_normalize, scale_rows
from jaxserve.layers.rotary import (
    apply_mrope,
    apply_rotary,
    rope_attention_factor,
    rope_inv_freq,
)
from pallas_kernels.paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.paged_attention.choice import choose_kernel, mosaic_kernel
from pallas_kernels.paged_attention.cpu import (
    cpu_kernel_unavailable_message,
    ragged_paged_attention_cpu,
)

logger = logging.getLogger(__name__)

# pallas: the GPU kernel; cpu: decode rows in a C++ kernel, the rest as the reference (the
# default on CPU where it builds); reference: the pure-jnp op.
ATTENTION_BACKENDS = ("pallas", "cpu", "reference")


def default_attention_backend(platform: str) -> str:
    """The backend for a device platform: pallas on GPU; on CPU the C++ decode kernel, or the
    reference (with a warning that says why) where it cannot be built."""
    if platform == "gpu":
        return "pallas"
    if platform == "cpu":
        reason = cpu_kernel_unavailable_message()
        if reason is None:
            return "cpu"
        logger.warning("%s; using --attention-backend reference", reason)
    return "reference"


class AttentionMetadata(NamedTuple):
    """Where a flat batch's tokens live in the paged KV cache (all int32, padded to buckets).

    slot_mapping:    [G, T] cache slot (block_id * block_size + offset) each new token's K/V is
                     written to in each KV-cache group (config/kv_groups.py); negative for
                     padding tokens (written to row 0, a null block: `write_kv`). [T] for
                     a cache of one group.
    block_tables:    [G, S, max_blocks] block ids of each sequence in each group ([S,
                     max_blocks] for one group).
    kv_lens:         [S] tokens cached per sequence after this step's tokens are written.
    query_start_loc: [S+1] offsets of each sequence's tokens in the flat batch.
    num_seqs:        [1] sequences in use; later rows of the arrays above are padding.
    decode_only:     (static, a Python bool) every sequence in use has exactly one token: the
                     attention runs its decode path alone. Part of the pytree's structure, not
                     a leaf, so a step compiled for one layout refuses inputs of the other.
    causal_ext:      [T] or None: each token also sees the keys up to this many positions
                     after its own (a bidirectional image's tokens, Gemma 3; 0 for text).
    layout:          (static) the KV-cache groups when there are several, else None: one
                     group of every layer, layer l at rows l * num_blocks + block.
    base_tables:     a layer's view (at_layer) keeps its group's tables as they came, and
    table_map:       (static) (scale, shift) with block_tables = base_tables * scale + shift:
                     a kernel that maps the ids itself reads base_tables (XLA then drops the
                     per-layer add), None elsewhere.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array
    decode_only: bool = False
    causal_ext: jax.Array | None = None
    layout: KVCacheLayout | None = None
    base_tables: jax.Array | None = None
    table_map: tuple[int, int] | None = None

    def group_view(self, group: int) -> AttentionMetadata:
        """This metadata for one KV-cache group: its block tables [S, max_blocks] and slots
        [T], no layout."""
        tables, slots = self.block_tables, self.slot_mapping
        if tables.ndim == 3:
            tables, slots = tables[group], slots[group]
        return self._replace(block_tables=tables, slot_mapping=slots, layout=None)

    def at_layer(self, index: int, cache: jax.Array, num_layers: int) -> AttentionMetadata:
        """This metadata for the cache's index-th layer (of num_layers), in its group's
        slot s of the [num_slots * num_blocks, block_size, ...] cache: its blocks are rows
        s * num_blocks + block_id (padding slots stay < 0). Without a layout every layer is
        its own slot of one group. A group packing k layers in a slot (KVCacheGroup.pack):
        the layer views the cache as [k * rows, block_size, ...] (each row's bytes k rows of
        its narrower width) and the sub-th of them uses view row k * row + sub."""
        layout = self.layout or KVCacheLayout.uniform(num_layers)
        group, slot, sub, pack = layout.place(index)
        md = self.group_view(group)
        offset = slot * (cache.shape[0] // layout.num_slots)
        bs, s = cache.shape[1], md.slot_mapping
        rows = (s // bs + offset) * pack + sub
        slots = jnp.where(s >= 0, rows * bs + s % bs, -1)
        tables = (md.block_tables + offset) * pack + sub
        return md._replace(
            block_tables=tables,
            slot_mapping=slots,
            base_tables=md.block_tables,
            table_map=(pack, offset * pack + sub),
        )


_LEAVES = (
    "slot_mapping",
    "block_tables",
    "kv_lens",
    "query_start_loc",
    "num_seqs",
    "causal_ext",
    "base_tables",
)
jax.tree_util.register_pytree_with_keys(
    AttentionMetadata,
    lambda md: (
        [(jax.tree_util.GetAttrKey(k), getattr(md, k)) for k in _LEAVES],
        (md.decode_only, md.layout, md.table_map),
    ),
    lambda static, arrays: AttentionMetadata(
        *arrays[:5],
        decode_only=static[0],
        causal_ext=arrays[5],
        layout=static[1],
        base_tables=arrays[6],
        table_map=static[2],
    ),
    flatten_func=lambda md: (
        (*md[:5], md.causal_ext, md.base_tables),
        (md.decode_only, md.layout, md.table_map),
    ),
)


def write_kv(cache: jax.Array, new: jax.Array, slots: jax.Array, scale: float = 1.0) -> jax.Array:
    """Scatter new: [T, Hkv, D] into cache: [num_blocks, block_size, Hkv, D] at slots: [T].

    An fp8 cache stores new / scale, saturated at the format's largest value (a plain cast
    would make NaN of anything past it). Negative slots (padding) write row 0 of the cache,
    a null block (core/block_pool.py: never handed out, only ever read masked), so a
    one-token write is one dynamic-update-slice. With the cache donated this updates it in
    place. The scatter indexes the 4-D cache by (block, offset): on a reshaped view XLA:CPU
    turns a one-token write into a dynamic-update-slice of the view, which it runs on a copy
    of the whole cache.
    """
    block_size = cache.shape[1]
    if is_fp8(cache.dtype):
        top = float(jnp.finfo(cache.dtype).max)
        new = jnp.clip(new.astype(jnp.float32) / scale, -top, top)
    slots = jnp.maximum(slots, 0)  # padding: the null block's first row
    new = new.astype(cache.dtype)
    if slots.shape[0] == 1:  # one token: a dynamic-update-slice (a scatter skips out-of-range
        # rows, which XLA keeps as a bounds check, a read of the old row and a select)
        start = (slots[0] // block_size, slots[0] % block_size, 0, 0)
        return jax.lax.dynamic_update_slice(cache, new[None], start)
    return cache.at[slots // block_size, slots % block_size].set(new, mode="promise_in_bounds")


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "reference",
    mesh: Mesh | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
    latent_dim: int | None = None,
) -> jax.Array:
    """q [T, Hq, D] over caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D]; sinks [Hq]:
    each head's attention-sink logit (gpt-oss), or None; attention_chunk: each query sees
    only the keys of its own chunk of that many positions (Llama 4), or None. latent_dim:
    MLA's kv_lora_rank r (K is [latent; rotary key], V the latent): the output's first r
    columns are the attention (the Pallas kernel returns only those: [T, Hq, r]).

    backend "reference" is the jnp op (XLA partitions it over `mesh` by itself); "pallas" is
    the kernel, compiled for a GPU and interpreted elsewhere; "cpu" has its decode rows
    computed by a C++ kernel (XLA:CPU). The kernels run per device over its own heads when
    the mesh splits them (shard_map: a custom call cannot be auto-partitioned). Each runs its
    decode path alone when md.decode_only says the batch is all decodes.
    """
    args = (
        q,
        k_cache,
        v_cache,
        md.kv_lens,
        md.block_tables,
        md.query_start_loc,
        md.num_seqs,
        sinks,
    )
    scores = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        attention_chunk=attention_chunk,
    )
    if md.causal_ext is not None and not md.decode_only:  # bidirectional images
        scores["causal_ext"] = md.causal_ext
        if backend == "pallas":  # its prefill kernel is causal only
            backend = "reference"
    if backend == "reference":
        return ragged_paged_attention_reference(*args, **scores, decode_only=md.decode_only)
    if backend == "cpu":
        kernel = functools.partial(ragged_paged_attention_cpu, **scores, decode_only=md.decode_only)
    else:
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        pallas = _pallas_kernel(device, q, k_cache, attention_chunk, latent_dim)
        if pallas is mosaic_kernel() and md.base_tables is not None:
            # the kernel maps the layer's block ids itself: no XLA add on the tables per layer
            args = (*args[:4], md.base_tables, *args[5:], jnp.array(md.table_map, jnp.int32))
        kernel = functools.partial(
            pallas,
            **scores,
            decode_only=md.decode_only,
            interpret=device.platform != "gpu",
            latent_dim=latent_dim,
        )
    if mesh is None or mesh.shape[TP_AXIS] == 1:
        return kernel(*args)
    heads, cache = P(None, TP_AXIS, None), P(None, None, TP_AXIS, None)
    specs = (heads, cache, cache, P(), P(), P(), P(), P(TP_AXIS), P())[: len(args)]
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)


def _pallas_kernel(device, q, cache, attention_chunk, latent_dim):
    """The Pallas kernel for a GPU (pallas_kernels/paged_attention/choice.py: Mosaic GPU where
    the suite measured it faster, else Triton); elsewhere Triton's, interpreted."""
    if device.platform != "gpu" or mosaic_kernel() is None:
        return ragged_paged_attention
    choice = choose_kernel(
        device.device_kind,
        q_dtype=q.dtype.name,
        cache_dtype=cache.dtype.name,
        head_dim=q.shape[-1],
        block_size=cache.shape[1],
        attention_chunk=attention_chunk,
        latent_dim=latent_dim,
        compute_capability=getattr(device, "compute_capability", None),
    )
    return mosaic_kernel() if choice == "mosaic" else ragged_paged_attention


def configure_attention(model: nnx.Module, backend: str, mesh: Mesh | None) -> None:
    """Make every Attention layer of `model` use `backend` (see `paged_attention`; checked by
    EngineArgs). The CPU kernel is registered with XLA here, before any executable that calls
    it is compiled or loaded."""
    if backend == "cpu" and (reason := cpu_kernel_unavailable_message()) is not None:
        raise RuntimeError(reason)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Attention):
            module.backend, module.mesh = backend, mesh


class Attention(nnx.Module):
    """Self-attention over the paged cache with one fused qkv projection.

    qkv_proj's output columns are grouped by the KV head as the cache stores it: for each of
    the Hkv * replicas cache heads (see distributed/sharding.py), its G query heads, then its
    key, then its value, each hd wide. So q, k and v are slices of one matmul's output, and
    under tensor parallelism each device's contiguous share of the columns is whole groups.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        layer: int = 0,
        kv_replicas: int = 1,
        rngs: nnx.Rngs,
        norm_cls: type = RMSNorm,
    ):
        """layer: which decoder layer (its sliding window and rotary); norm_cls: the q/k norm
        (Qwen3's RMSNorm, Gemma 3's)."""
        d, hq, hd = config.hidden_size, config.num_heads, config.head_dim
        self.num_kv_heads = config.num_kv_heads * kv_replicas  # as the cache holds them
        self.group = hq // self.num_kv_heads
        width = self.num_kv_heads * (self.group + 2) * hd
        quant = config.linear_kwargs()
        self.qkv_proj = Linear(
            d, width, bias=config.attention_bias, dtype=config.dtype, rngs=rngs, **quant
        )
        self.o_proj = Linear(
            hq * hd, d, bias=config.o_proj_bias, dtype=config.dtype, rngs=rngs, **quant
        )
        # Qwen3-Next: each head's output times sigmoid(x . gate_proj) before o_proj
        self.gate_proj = (
            Linear(d, hq * hd, dtype=config.dtype, rngs=rngs, **quant)
            if config.attn_output_gate
            else None
        )
        # gpt-oss: a logit per query head that every softmax's denominator also sums
        self.sinks = nnx.Param(jnp.zeros((hq,), config.dtype)) if config.attention_sinks else None
        if config.qk_norm:
            self.q_norm = norm_cls(hd, config.rms_norm_eps, dtype=config.dtype)
            self.k_norm = norm_cls(hd, config.rms_norm_eps, dtype=config.dtype)
        elif config.qk_norm_over_heads:  # MiniMax-M2's: over each whole projection
            eps, dt = config.rms_norm_eps, config.dtype
            self.q_norm = HeadsRMSNorm(hq, hd, eps, dtype=dt)
            self.k_norm = HeadsRMSNorm(self.num_kv_heads, hd, eps, dtype=dt)
        self.qk_norm = config.qk_norm or config.qk_norm_over_heads
        self.rope = config.layer_rope(layer)
        self.use_rope = layer not in config.nope_layers
        self.qk_l2_norm = config.qk_l2_norm and self.use_rope
        self.l2_eps = config.rms_norm_eps
        self.temperature = None if self.use_rope else config.attn_temperature
        self.sliding_window = config.layer_window(layer)
        self.chunk = config.layer_chunk(layer)
        self.sm_scale = (config.query_pre_attn_scalar or hd) ** -0.5
        self.soft_cap = config.attn_logit_softcapping
        self.head_dim = hd
        self.rotary_dim = config.rotary_dim or hd  # partial rotary: the leading dims only
        self.backend, self.mesh = "reference", None  # configure_attention sets these
        # An fp8 cache holds K / k_scale and V / v_scale (the checkpoint's, when it has them:
        # loader.load_kv_scales); a wider cache ignores them.
        self.k_scale, self.v_scale = 1.0, 1.0

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        md: AttentionMetadata,
        lora: LoRABatch | None = None,
        row_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [T, D], positions: [T] (or M-RoPE's [3, T]), caches [num_blocks, block_size,
        Hkv, hd]; lora: the tokens' adapter slots (layers/lora.py) for qkv_proj and o_proj;
        row_scale: f32[T] or None, x's rows times it (RMSNorm.split), applied to qkv_proj's
        output where that is linear in x (no bias, no output gate).

        Returns (out [T, D], k_cache, v_cache) with this step's K/V written.
        """
        t, hd, g = x.shape[0], self.head_dim, self.group
        x, row_scale = _scale_input(x, row_scale, self.qkv_proj.bias, self.gate_proj)
        qkv = scale_rows(self.qkv_proj(x, lora), row_scale)
        qkv = qkv.reshape(t, self.num_kv_heads, g + 2, hd)  # [T, Hkv, G + 2, hd]
        inv_freq = rope_inv_freq(self.rotary_dim, self.rope)  # a trace-time constant
        q, k = qkv[:, :, :g].reshape(t, -1, hd), qkv[:, :, g]  # [T, Hq, hd], [T, Hkv, hd]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_l2_norm:  # weightless: commutes with the rotation, so before it
            q = rms_normalize(q, self.l2_eps).astype(q.dtype)
            k = rms_normalize(k, self.l2_eps).astype(k.dtype)
        if self.use_rope:
            scale = rope_attention_factor(self.rope)
            if positions.ndim == 2:  # M-RoPE's [3, T] (Qwen2.5-VL)
                section = self.rope.mrope_section
                mixed = self.rope.mrope_interleaved
                q = apply_mrope(q, positions, inv_freq, section, scale, mixed)
                k = apply_mrope(k, positions, inv_freq, section, scale, mixed)
            else:
                q = apply_rotary(q, positions, inv_freq, scale)
                k = apply_rotary(k, positions, inv_freq, scale)
        if self.temperature is not None:  # Llama 4's layers without rotary
            floor_scale, attn_scale = self.temperature
            pos = positions.astype(jnp.float32)
            tune = jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * tune[:, None, None]).astype(q.dtype)
        v = qkv[:, :, g + 1]  # [T, Hkv, hd]
        k_scale, v_scale = (self.k_scale, self.v_scale) if is_fp8(k_cache.dtype) else (1.0, 1.0)
        k_cache = write_kv(k_cache, k, md.slot_mapping, k_scale)
        v_cache = write_kv(v_cache, v, md.slot_mapping, v_scale)
        # q . (k_scale * k8) = k_scale * (q . k8), and sum p (v_scale * v8) = v_scale * sum p v8:
        # the scales fold into the score scale and the output, outside the attention op.
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            md,
            sm_scale=self.sm_scale * k_scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
            backend=self.backend,
            mesh=self.mesh,
            sinks=None if self.sinks is None else self.sinks[...],
            attention_chunk=self.chunk,
        )
        if v_scale != 1.0:
            out = out * jnp.asarray(v_scale, out.dtype)
        out = out.reshape(t, -1)
        if self.gate_proj is not None:
            out = out * jax.nn.sigmoid(self.gate_proj(x))
        return self.o_proj(out, lora), k_cache, v_cache


def _scale_input(x: jax.Array, row_scale, *nonlinear) -> tuple[jax.Array, jax.Array | None]:
    """(x, row_scale) as a projection takes them: x's rows scaled now where `nonlinear` has
    anything (a bias, a gate: the output would not scale with the input)."""
    if row_scale is None or all(n is None for n in nonlinear):
        return x, row_scale
    return scale_rows(x, row_scale), None
