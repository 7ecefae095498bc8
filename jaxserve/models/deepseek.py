"""DeepSeek-V3 / R1 and Kimi K2 (DeepseekV3ForCausalLM): multi-head latent attention (MLA)
over a latent paged cache, and GLM-4.5's mixture of experts (noaux_tc routing, shared experts,
dense first layers: models/glm4_moe.py). DeepSeek-V2 (DeepseekV2ForCausalLM) is the same but
for its softmax routing.

MLA, as vLLM's MLA backends run it: each token's KV is kept as the compressed latent
c = kv_a_layernorm(kv_a(x))[:r] and the rotary key k_pe, one cache "head" of r + rope values
(config/mla.py), replicated on every tensor-parallel rank.
  absorbed  (decodes, and prefill chunks that continue a cached context): kv_b_proj's key
            half W_UK [H, nope, r] is folded into the query (q_nope W_UK: [T, H, r]) and its
            value half W_UV [H, v, r] applied after the attention, so the attention is GQA
            with one KV head over [latent; rotary key] whose values are the latent (the V
            cache stays empty: K is passed as V and the rotary part of the output dropped);
  expanded  (sequences whose whole context is this step's tokens: a prompt's first chunk
            without a prefix-cache hit): keys [k_nope = c W_UK; k_pe] and values c W_UV per
            head, HF's form, attended among the step's own tokens: (nope + rope) + v values
            a score and output instead of 2r + rope, the cheaper form where each latent
            serves many queries (`expanded_attention`).
Both give HF's scores and outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import Attention, AttentionMetadata, paged_attention, write_kv
from jaxserve.layers.linear import Linear
from jaxserve.layers.norm import RMSNorm
from jaxserve.layers.rotary import apply_rotary, rope_attention_factor, rope_inv_freq
from jaxserve.models.llama import DecoderLayer, HFWeight, LlamaForCausalLM
from jaxserve.models.weight_maps import GATE_UP_DOWN, compose, routed_experts, shared_experts

LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm (not rms_norm_eps)


class MLAAttention(Attention):
    """Weights: q_a_proj [D, q_lora], q_a_layernorm, q_b_proj [q_lora, H * (nope + rope)] (or
    q_proj [D, H * (nope + rope)]); kv_a_proj_with_mqa [D, r + rope], kv_a_layernorm [r];
    w_uk [H, nope, r] and w_uv [H, v, r] (kv_b_proj split per head); o_proj [H * v, D].
    Caches: K [blocks, block_size, R, r + rope] (R = the tensor-parallel replicas), V empty."""

    def __init__(
        self, config: ModelConfig, *, layer: int = 0, kv_replicas: int = 1, rngs: nnx.Rngs
    ):
        m, d, h, dt = config.mla, config.hidden_size, config.num_heads, config.dtype
        init = nnx.initializers.lecun_normal()
        bias = config.attention_bias
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = config.linear_kwargs()  # quantized as the decoder's other linear layers
        if m.q_lora_rank is None:
            self.q_proj = Linear(d, h * qk, dtype=dt, rngs=rngs, **q)
        else:
            self.q_a_proj = Linear(d, m.q_lora_rank, bias=bias, dtype=dt, rngs=rngs, **q)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dtype=dt)
            self.q_b_proj = Linear(m.q_lora_rank, h * qk, dtype=dt, rngs=rngs, **q)
        self.kv_a_proj_with_mqa = Linear(d, m.latent_dim, bias=bias, dtype=dt, rngs=rngs, **q)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dtype=dt)
        self.w_uk = nnx.Param(init(rngs.params(), (h, m.qk_nope_head_dim, m.kv_lora_rank), dt))
        self.w_uv = nnx.Param(init(rngs.params(), (h, m.v_head_dim, m.kv_lora_rank), dt))
        self.o_proj = Linear(h * m.v_head_dim, d, bias=bias, dtype=dt, rngs=rngs, **q)
        self.mla = m
        self.num_heads = h
        self.num_kv_heads = kv_replicas  # the latent, once per tensor-parallel rank
        self.rope = config.layer_rope(layer)
        self.sliding_window, self.soft_cap = None, None
        self.backend, self.mesh = "reference", None  # configure_attention sets these
        self.k_scale, self.v_scale = 1.0, 1.0

    def _rotary(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """The rotary part [T, H, rope]; interleaved pairs (DeepSeek's layout) are first laid
        out as rotate-half's halves, the same permutation for q and k."""
        if self.mla.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        inv_freq = rope_inv_freq(self.mla.qk_rope_head_dim, self.rope)
        return apply_rotary(x, positions, inv_freq, rope_attention_factor(self.rope))

    def project(self, x: jax.Array, positions: jax.Array, q_resid: jax.Array | None = None):
        """x: [T, D] -> (the absorbed query [T, H, r + rope], q_nope [T, H, nope], the latent
        [T, r], the rotary key [T, 1, rope]); q_resid: q_a_layernorm(q_a_proj(x)) if known."""
        m, t, h = self.mla, x.shape[0], self.num_heads
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x)) if q_resid is None else q_resid
            q = self.q_b_proj(q_resid)
        q = q.reshape(t, h, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x)  # [T, r + rope]
        latent = self.kv_a_layernorm(kv[:, : m.kv_lora_rank])
        k_pe = self._rotary(kv[:, None, m.kv_lora_rank :], positions)  # [T, 1, rope]
        q_latent = jnp.einsum("thn,hnr->thr", q_nope, self.w_uk[...])
        query = jnp.concatenate([q_latent, self._rotary(q_pe, positions)], axis=-1)
        return query, q_nope, latent, k_pe

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        md: AttentionMetadata,
    ):
        """x: [T, D] -> ([T, D], k_cache, v_cache) with this step's latents written."""
        m, t, h = self.mla, x.shape[0], self.num_heads
        query, q_nope, latent, k_pe = self.project(x, positions)
        entry = jnp.concatenate([latent[:, None], k_pe.astype(latent.dtype)], axis=-1)
        entry = jnp.broadcast_to(entry, (t, self.num_kv_heads, m.latent_dim))
        k_cache = write_kv(k_cache, entry, md.slot_mapping)
        fresh = None
        if not md.decode_only:  # fresh sequences take the expanded form: none absorbed
            real = jnp.arange(md.kv_lens.shape[0]) < md.num_seqs[0]
            q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
            fresh = real & (md.kv_lens == q_lens) & (q_lens > 1)
            md = md._replace(kv_lens=jnp.where(fresh, 0, md.kv_lens))
        out = paged_attention(
            query,
            k_cache,
            k_cache,
            md,
            sm_scale=m.sm_scale,
            backend=self.backend,
            mesh=self.mesh,
            latent_dim=m.kv_lora_rank,
        )
        out = jnp.einsum("thr,hvr->thv", out[..., : m.kv_lora_rank], self.w_uv[...])
        if fresh is not None:
            keys = jnp.concatenate(
                [
                    jnp.einsum("tr,hnr->thn", latent, self.w_uk[...]),
                    jnp.broadcast_to(k_pe, (t, h, m.qk_rope_head_dim)).astype(latent.dtype),
                ],
                -1,
            )
            values = jnp.einsum("tr,hvr->thv", latent, self.w_uv[...])
            queries = jnp.concatenate([q_nope, query[..., m.kv_lora_rank :]], axis=-1)
            out = expanded_attention(queries, keys, values, out, fresh, md, m.sm_scale)
        return self.o_proj(out.reshape(t, -1)), k_cache, v_cache


EXPANDED_TILE = 128  # query rows per tile of the expanded form's scores [H, tile, T]


def expanded_attention(q, k, v, out, fresh, md: AttentionMetadata, sm_scale: float):
    """Causal attention among the step's own tokens for the `fresh` sequences (bool[S]: their
    whole context is this step's tokens): q, k [T, H, nope + rope], v [T, H, dv]; their rows
    of out [T, H, dv] are replaced, the others kept. Skipped (lax.cond) in steps without
    one; query rows run EXPANDED_TILE at a time over all T keys, masked to their sequence."""
    t = q.shape[0]
    qsl = md.query_start_loc
    seq = jnp.searchsorted(qsl[1:], jnp.arange(t), side="right")  # [T]; S past the last
    row_fresh = fresh[jnp.minimum(seq, fresh.shape[0] - 1)] & (jnp.arange(t) < qsl[-1])
    pad = -t % EXPANDED_TILE
    tiles = (t + pad) // EXPANDED_TILE
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def tile(i):
        rows = i * EXPANDED_TILE + jnp.arange(EXPANDED_TILE)
        r = jnp.minimum(rows, t - 1)
        s = jnp.einsum("qhd,khd->hqk", q[r].astype(jnp.float32), kf) * sm_scale
        keys = jnp.arange(t)
        seen = (seq[keys][None, :] == seq[r][:, None]) & (keys[None, :] <= r[:, None])
        s = jnp.where(seen[None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("hqk,khd->qhd", p, vf)

    def expanded(out):
        res = jax.lax.map(tile, jnp.arange(tiles)).reshape(t + pad, *out.shape[1:])[:t]
        return jnp.where(row_fresh[:, None, None], res.astype(out.dtype), out)

    return jax.lax.cond(jnp.any(row_fresh), expanded, lambda out: out, out)


class DeepseekDecoderLayer(DecoderLayer):
    attention_cls = MLAAttention


def mla_attention(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
    """MLA's projections (`self_attn.*`), with kv_b_proj split per head into w_uk and w_uv."""
    if names[0] != "layers" or names[2] != "self_attn":
        return None
    prefix = f"model.layers.{names[1]}.self_attn"
    m, h = config.mla, config.num_heads
    if names[3] in ("w_uk", "w_uv"):  # kv_b_proj [H * (nope + v), r], per head
        nope = m.qk_nope_head_dim
        part = slice(None, nope) if names[3] == "w_uk" else slice(nope, None)
        return HFWeight(
            (f"{prefix}.kv_b_proj.weight",),
            lambda w: w.reshape(h, nope + m.v_head_dim, m.kv_lora_rank)[:, part],
        )
    suffix = "bias" if names[-1] == "bias" else "weight"
    name = f"{prefix}.{names[3]}.{suffix}"
    if names[-1] == "kernel":
        return HFWeight((name,), np.transpose)
    return HFWeight((name,))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """MLA attention, GLM-4.5's experts (Kimi K2 too)."""

    layer_cls = DeepseekDecoderLayer
    hf_weight = compose(mla_attention, shared_experts, routed_experts("mlp", GATE_UP_DOWN))


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2.5 / V2-Lite: V3's MLA and weight names, routed by softmax
    (config/moe.py's "softmax_group": `greedy` or `group_limited_greedy`) with no bias."""
