"""Gemma 4 (text: Gemma4ForCausalLM) in Flax NNX: Gemma 3's sandwich-normed layers with the
differences config/gemma4.py lists -- full layers of their own width (K and V shared with
`attention_k_eq_v`), proportional rotary, KV-sharing layers that read an earlier layer's
cache, per-layer embeddings, routed experts beside the dense MLP, a learned scalar per layer.

The paged cache holds every cached layer in rows of one width, [H_c, d] per token (H_c the
cache heads, d the sliding layers' head_dim; distributed/sharding.py::kv_head_replicas picks
H_c so each device's share is whole heads of every width). A layer of H_l heads of d_l that
fills 1/k of a row shares its slot with k - 1 others of its kind (config/kv_groups.py::
layer_packs, when the KV-cache groups allow): it views the cache as [k * rows, block_size,
H_c d / (k d_l), d_l], a reshape per device (inside a shard_map under tp: a global reshape
of a head-split cache would mix heads into tokens), and uses view row k * row + its place
(AttentionMetadata.at_layer). Gemma 4 31B's full layers (4 heads of 512 beside 16 of 256)
pack two a slot. Where they cannot (one group of every layer; a device's share of a row
holding one of its heads) the layer views the rows as [H_c d / d_l, d_l] and repeats its
heads to fill them, as tensor parallelism repeats KV heads past their count. The qkv kernel
always holds each head as often as the repeat needs; packing keeps one copy of the K / V it
computes. Every attention backend sees an ordinary paged cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.layers.attention import Attention, AttentionMetadata, paged_attention, write_kv
from jaxserve.layers.fused_moe import FusedMoE, route
from jaxserve.layers.linear import Linear
from jaxserve.layers.mlp import GatedMLP
from jaxserve.layers.norm import RMSNorm, rms_normalize
from jaxserve.layers.rotary import apply_rotary, rope_inv_freq
from jaxserve.models.llama import HFWeight, LlamaForCausalLM, fuse_gate_up, with_images
from jaxserve.models.step_inputs import StepInputs


class Gemma4RMSNorm(RMSNorm):
    """y = weight * x / rms(x), all in float32, cast back (HF Gemma4RMSNorm)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in x's dtype."""
        return (self.normalized(x) * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class Gemma4Attention(Attention):
    """One layer's attention. qkv_proj's columns are grouped per viewed cache head (as
    layers/attention.py's): its G query heads, then (unless the layer shares an earlier
    layer's KV) its key, then its value (none when V is the key's projection). An Attention
    for `configure_attention` (its backend and mesh); its own parameters."""

    def __init__(self, config: ModelConfig, layer: int, *, kv_replicas: int, rngs: nnx.Rngs):  # noqa: PLW0231
        g4, d, hq = config.gemma4, config.hidden_size, config.num_heads
        heads, hd = config.layer_kv_shape(layer)
        self.window = config.layer_window(layer)
        self.shared = g4.shares[layer] is not None
        self.k_eq_v = g4.k_eq_v and self.window is None
        self.bidirectional = g4.bidirectional_images and self.window is not None
        self.head_dim = hd
        row = config.num_kv_heads * kv_replicas * config.head_dim  # a token's cache row
        self.view_heads = row // hd
        if row % hd or self.view_heads % heads or hq % self.view_heads:
            raise ValueError(
                f"layer {layer}: {heads} KV heads of {hd} do not fill a cache row of "
                f"{config.num_kv_heads * kv_replicas} heads of {config.head_dim} "
                "(kv_replicas from distributed/sharding.py::kv_head_replicas)"
            )
        self.group = hq // self.view_heads
        self.parts = self.group + (0 if self.shared else 1 if self.k_eq_v else 2)
        dt, quant = config.dtype, config.linear_kwargs()
        self.qkv_proj = Linear(d, self.view_heads * self.parts * hd, dtype=dt, rngs=rngs, **quant)
        self.o_proj = Linear(hq * hd, d, dtype=dt, rngs=rngs, **quant)
        self.q_norm = Gemma4RMSNorm(hd, config.rms_norm_eps, dtype=dt)
        self.k_norm = None if self.shared else Gemma4RMSNorm(hd, config.rms_norm_eps, dtype=dt)
        self.eps = config.rms_norm_eps
        self.rope = config.layer_rope(layer)
        self.backend, self.mesh = "reference", None  # configure_attention sets these

    def __call__(self, x, positions, k_cache, v_cache, md: AttentionMetadata, pack: int = 1):
        """x: [T, D] -> ([T, D], k_cache, v_cache): caches [rows, block_size, H_c, d], this
        step's K/V written unless the layer shares an earlier layer's. pack: the layer
        shares its slot with pack - 1 others (md's tables address its view, AttentionMetadata.
        at_layer): it keeps one of each pack copies of its heads."""
        t, hd, g = x.shape[0], self.head_dim, self.group
        qkv = self.qkv_proj(x).reshape(t, self.view_heads, self.parts, hd)
        inv_freq = rope_inv_freq(hd, self.rope)  # a trace-time constant
        q = apply_rotary(self.q_norm(qkv[:, :, :g].reshape(t, -1, hd)), positions, inv_freq)
        kv = ()
        if not self.shared:
            raw = qkv[:, :, g]  # [T, Hv, hd]
            k = apply_rotary(self.k_norm(raw), positions, inv_freq)
            v = rms_normalize(raw if self.k_eq_v else qkv[:, :, g + 1], self.eps).astype(x.dtype)
            # [T, Hv / pack, hd]: the copies of a head are neighbours, a device's whole
            kv = tuple(a.reshape(t, -1, pack, hd)[:, :, 0] for a in (k, v))
        if not self.bidirectional:  # an image's tokens see one another in sliding layers only
            md = md._replace(causal_ext=None)

        def attend(q, kv, k_cache, v_cache, md, mesh=None):
            """On one device's heads when split (the packed view is a per-device reshape)."""
            heads = k_cache.shape[2] * k_cache.shape[3] // (pack * hd)
            view = (k_cache.shape[0] * pack, k_cache.shape[1], heads, hd)
            k_view, v_view = k_cache.reshape(view), v_cache.reshape(view)
            if kv:
                k_view = write_kv(k_view, kv[0], md.slot_mapping)
                v_view = write_kv(v_view, kv[1], md.slot_mapping)
            out = paged_attention(
                q,
                k_view,
                v_view,
                md,
                sm_scale=1.0,
                sliding_window=self.window,
                backend=self.backend,
                mesh=mesh,
            )
            return out, k_view.reshape(k_cache.shape), v_view.reshape(v_cache.shape)

        if pack == 1 or self.mesh is None or self.mesh.shape[TP_AXIS] == 1:
            out, k_cache, v_cache = attend(q, kv, k_cache, v_cache, md, self.mesh)
        else:
            heads, cache = P(None, TP_AXIS, None), P(None, None, TP_AXIS, None)
            out, k_cache, v_cache = jax.shard_map(
                attend,
                mesh=self.mesh,
                in_specs=(heads, heads, cache, cache, P()),
                out_specs=(heads, cache, cache),
                check_vma=False,
            )(q, kv, k_cache, v_cache, md)
        return self.o_proj(out.reshape(t, -1)), k_cache, v_cache


class Gemma4Experts(FusedMoE):
    """The routed experts beside the dense MLP: routed on the layer's un-normed input (a
    weightless RMSNorm, times `router_gain` / sqrt(D)), softmax top-k renormalised, each
    weight times its expert's `expert_gain`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.router_gain = nnx.Param(jnp.ones((config.hidden_size,), config.dtype))
        self.expert_gain = nnx.Param(jnp.ones((config.num_experts,), config.dtype))
        self.eps = config.rms_norm_eps

    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        """x: the experts' input [T, D]; residual: the router's [T, D] -> [T, D]."""
        h = rms_normalize(residual, self.eps).astype(residual.dtype)
        h = h * self.router_gain[...] * jnp.asarray(residual.shape[-1] ** -0.5, h.dtype)
        ids, weights = route(self.gate(h), self.top_k, renormalize=True)
        weights = weights * self.expert_gain[...][ids].astype(jnp.float32)
        return self.routed(x, (ids, weights))


class Gemma4DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, kv_replicas: int, rngs: nnx.Rngs):
        g4, d, eps, dt = config.gemma4, config.hidden_size, config.rms_norm_eps, config.dtype
        norm = lambda dim=d: Gemma4RMSNorm(dim, eps, dtype=dt)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(config, layer, kv_replicas=kv_replicas, rngs=rngs)
        wide = 2 if g4.double_wide_mlp and g4.shares[layer] is not None else 1
        mlp = dict(dtype=dt, rngs=rngs, act=config.hidden_act, linear=config.linear_kwargs())
        # named as other families' dense MLPs and experts are (sharding rules, roofline)
        self.dense_mlp = GatedMLP(d, config.intermediate_size * wide, **mlp)
        self.mlp = Gemma4Experts(config, rngs=rngs) if g4.moe_block else None
        if g4.moe_block:
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            self.pre_feedforward_layernorm_2 = norm()
        if g4.ple_dim:
            self.per_layer_input_gate = Linear(d, g4.ple_dim, dtype=dt, rngs=rngs)
            self.per_layer_projection = Linear(g4.ple_dim, d, dtype=dt, rngs=rngs)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = nnx.Param(jnp.ones((1,), dt))

    def __call__(self, x, positions, k_cache, v_cache, md: AttentionMetadata, ple=None, pack=1):
        """x: [T, D], ple: this layer's per-layer input [T, P] (or None) -> ([T, D], k_cache,
        v_cache); pack: the layers its cache slot holds (Gemma4Attention)."""
        attn, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), positions, k_cache, v_cache, md, pack
        )
        x = x + self.post_attention_layernorm(attn)
        h = self.dense_mlp(self.pre_feedforward_layernorm(x))
        if self.mlp is not None:
            routed = self.mlp(self.pre_feedforward_layernorm_2(x), x)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if ple is not None:
            gate = jax.nn.gelu(self.per_layer_input_gate(x), approximate=True) * ple
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar[...], k_cache, v_cache


class Gemma4ForCausalLM(LlamaForCausalLM):
    """Gemma4ForCausalLM (Gemma4ForConditionalGeneration's language model: models/vlm.py)."""

    layer_cls = Gemma4DecoderLayer
    norm_cls = Gemma4RMSNorm
    embed_scale = True
    eagle_target = False  # (no EAGLE heads are published for it: untested)

    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        super().__init__(config, kv_replicas=kv_replicas, rngs=rngs)
        g4, dt = config.gemma4, config.dtype
        if g4.ple_dim:
            width = config.num_layers * g4.ple_dim
            self.embed_tokens_per_layer = nnx.Embed(
                g4.ple_vocab, width, dtype=dt, param_dtype=dt, rngs=rngs
            )
            self.per_layer_model_projection = Linear(config.hidden_size, width, dtype=dt, rngs=rngs)
            self.per_layer_projection_norm = Gemma4RMSNorm(
                g4.ple_dim, config.rms_norm_eps, dtype=dt
            )

    def per_layer_inputs(self, input_ids: jax.Array, h: jax.Array) -> jax.Array | None:
        """Each token's input to every layer [T, L, P]: the per-layer embedding of its id
        (times sqrt(P)) and the normed projection of its embedding h [T, D] (times 1 /
        sqrt(D)), summed and times 1 / sqrt(2); None without per-layer embeddings. Image
        tokens (and ids past the table) look up the pad token's row, as HF does."""
        g4 = self.config.gemma4
        if not g4.ple_dim:
            return None
        t, p = h.shape[0], g4.ple_dim
        pad = self.config.hf_config.pad_token_id or 0
        ids = jnp.where((input_ids >= 0) & (input_ids < g4.ple_vocab), input_ids, pad)
        own = self.embed_tokens_per_layer(ids) * jnp.asarray(p**0.5, h.dtype)
        mixed = self.per_layer_model_projection(h) * jnp.asarray(h.shape[-1] ** -0.5, h.dtype)
        mixed = self.per_layer_projection_norm(mixed.reshape(t, -1, p))
        return (mixed + own.reshape(t, -1, p)) * jnp.asarray(2**-0.5, h.dtype)

    def __call__(self, inputs: StepInputs, kv_caches, aux_layers=(), final_norm=True):
        """inputs: the step's T tokens (models/step_inputs.py: input_ids, positions, attn,
        mm_rows / mm_embeds for images) -> (final hidden states [T, D], kv_caches)."""
        if aux_layers or inputs.hidden_in is not None:
            raise ValueError("Gemma 4 runs as one stage, without EAGLE-3 features")
        md, positions = inputs.attn, inputs.positions
        k_cache, v_cache = kv_caches
        h = self.embed_tokens(inputs.input_ids)
        h = h * jnp.asarray(self.config.hidden_size**0.5, h.dtype)
        ids = (
            inputs.input_ids
            if inputs.mm_rows is None
            else jnp.where(inputs.mm_rows >= 0, -1, inputs.input_ids)
        )
        h = with_images(h, inputs)
        ple = self.per_layer_inputs(ids, h)
        cached = self.config.kv_layers
        shares = self.config.gemma4.shares
        for i, layer in enumerate(self.layers):
            index = cached.index(i if shares[i] is None else shares[i])
            layer_md = md.at_layer(index, k_cache, len(cached))
            pack = md.layout.place(index)[3] if md.layout is not None else 1
            layer_ple = None if ple is None else ple[:, i]
            h, k_cache, v_cache = layer(h, positions, k_cache, v_cache, layer_md, layer_ple, pack)
        return (self.norm(h) if final_norm else h), (k_cache, v_cache)

    @classmethod
    def hf_weight(cls, config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        """Gemma 4's tensors; the rest as Llama's (models/vlm.py renames them under the
        multimodal checkpoint's prefix)."""
        names = tuple(str(p) for p in path)
        weight = _gemma4_weight(config, names, kv_replicas)
        return weight or LlamaForCausalLM.hf_weight(config, path, kv_replicas)


def _gemma4_weight(config: ModelConfig, names: tuple[str, ...], kv_replicas: int):
    """The HFWeight of a Gemma 4 parameter Llama's layout does not name, else None."""
    prefix = "model"
    transposed = lambda name: HFWeight((f"{prefix}.{name}.weight",), np.transpose)  # noqa: E731
    if names[0] == "per_layer_model_projection":
        return transposed(names[0])
    if names[0] != "layers":
        return None
    layer, module = f"layers.{names[1]}", names[2]
    if module in ("per_layer_input_gate", "per_layer_projection"):
        return transposed(f"{layer}.{module}")
    if module == "layer_scalar":
        return HFWeight((f"{prefix}.{layer}.layer_scalar",))
    if module == "self_attn" and names[3] == "qkv_proj":
        return _qkv_weight(config, int(names[1]), kv_replicas, f"{prefix}.{layer}.self_attn")
    if module == "dense_mlp":  # HF's mlp
        return LlamaForCausalLM.hf_weight(config, ("layers", names[1], "mlp", *names[3:]))
    if module != "mlp":  # (the experts)
        return None
    name = names[3]
    if name == "gate":  # the router's projection [E, D] -> [D, E]
        return transposed(f"{layer}.router.proj")
    if name in ("router_gain", "expert_gain"):  # ("_scale" names a quantized kernel's scale)
        hf = "scale" if name == "router_gain" else "per_expert_scale"
        return HFWeight((f"{prefix}.{layer}.router.{hf}",))
    if name == "w13":  # [E, 2F, D], gate rows then up rows -> [E, D, 2F] interleaved

        def interleave(w: np.ndarray) -> np.ndarray:
            gate, up = np.split(w, 2, axis=1)
            return np.stack([fuse_gate_up(g, u).T for g, u in zip(gate, up, strict=True)])

        return HFWeight((f"{prefix}.{layer}.experts.gate_up_proj",), interleave)
    return HFWeight((f"{prefix}.{layer}.experts.down_proj",), lambda w: w.swapaxes(1, 2))


def _qkv_weight(config: ModelConfig, layer: int, kv_replicas: int, attn: str) -> HFWeight:
    """Gemma4Attention's qkv_proj kernel [D, Hv (G + parts) hd] from HF's q, k (and v)
    projections: per viewed head, its G query heads, its key head repeated, its value."""
    g4 = config.gemma4
    heads, hd = config.layer_kv_shape(layer)
    view = config.num_kv_heads * kv_replicas * config.head_dim // hd
    if g4.shares[layer] is not None:
        return HFWeight((f"{attn}.q_proj.weight",), np.transpose)
    with_v = not (g4.k_eq_v and config.layer_window(layer) is None)
    names = tuple(f"{attn}.{p}_proj.weight" for p in ("qkv" if with_v else "qk"))

    def build(q: np.ndarray, k: np.ndarray, v: np.ndarray | None = None) -> np.ndarray:
        d = q.shape[1]
        parts = [q.reshape(view, -1, hd, d)]
        for w in (k, v) if v is not None else (k,):
            parts.append(np.repeat(w.reshape(heads, 1, hd, d), view // heads, axis=0))
        return np.concatenate(parts, axis=1).reshape(-1, d).T

    return HFWeight(names, build)
