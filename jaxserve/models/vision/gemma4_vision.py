"""Gemma 4's image path (HF `Gemma4Model.get_image_features`): the image processor's patches
(at the image's own aspect ratio, padded to max_soft_tokens * k * k patches, with (x, y)
positions, (-1, -1) for padding) -> a ViT with Gemma's sandwich RMSNorms, q / k / v norms,
unscaled scores and a 2-D rotary (each head's first half turned by x, the second by y), a
learned position table per axis -> the patches average-pooled k x k by position, times
sqrt(hidden) (optionally standardised) -> a weightless RMSNorm and one projection into the
text hidden size. Each image gives max_soft_tokens rows, the first (its patches / k**2)
real; the engine keeps those (the feature's length)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.linear import Linear
from jaxserve.layers.norm import rms_normalize
from jaxserve.layers.rotary import apply_rotary
from jaxserve.models.gemma4 import Gemma4RMSNorm
from jaxserve.models.llama import HFWeight

# the soft-token counts Gemma4ImageProcessor takes (its max_soft_tokens)
SOFT_TOKENS = (70, 140, 280, 560, 1120)


def vision_settings(config: dict) -> dict:
    """The vision config with HF Gemma4VisionConfig's defaults for what it leaves out."""
    defaults = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "pooling_kernel_size": 3,
        "patch_size": 16,
        "position_embedding_size": 10240,
        "use_clipped_linears": False,
        "standardize": False,
        "rope_parameters": {"rope_theta": 100.0},
    }
    return {
        **defaults,
        **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None},
    }


class ClippableLinear(nnx.Module):
    """A linear layer without bias whose input and output may be clamped to a checkpoint's
    bounds (HF Gemma4ClippableLinear, `use_clipped_linears`)."""

    def __init__(self, d_in: int, d_out: int, clipped: bool, *, dtype, rngs: nnx.Rngs):
        self.linear = Linear(d_in, d_out, dtype=dtype, rngs=rngs)
        self.clipped = clipped
        if clipped:
            bounds = (("input_min", -np.inf), ("input_max", np.inf))
            for name, value in (*bounds, ("output_min", -np.inf), ("output_max", np.inf)):
                setattr(self, name, nnx.Param(jnp.asarray(value, jnp.float32)))

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.clipped:
            return self.linear(x)
        x = jnp.clip(x, self.input_min[...].astype(x.dtype), self.input_max[...].astype(x.dtype))
        y = self.linear(x)
        return jnp.clip(
            y, self.output_min[...].astype(y.dtype), self.output_max[...].astype(y.dtype)
        )


class _Layer(nnx.Module):
    def __init__(self, vc: dict, *, dtype, rngs: nnx.Rngs):
        d, f, clip = vc["hidden_size"], vc["intermediate_size"], vc["use_clipped_linears"]
        h, kv, hd, eps = (
            vc[k]
            for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")
        )
        lin = lambda a, b: ClippableLinear(a, b, clip, dtype=dtype, rngs=rngs)  # noqa: E731
        norm = lambda n: Gemma4RMSNorm(n, eps, dtype=dtype)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(d, h * hd), lin(d, kv * hd), lin(d, kv * hd)
        self.o_proj = lin(h * hd, d)
        self.q_norm, self.k_norm = norm(hd), norm(hd)
        self.gate_proj, self.up_proj, self.down_proj = lin(d, f), lin(d, f), lin(f, d)
        self.input_layernorm, self.post_attention_layernorm = norm(d), norm(d)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(d), norm(d)
        self.heads, self.kv_heads, self.head_dim, self.eps = h, kv, hd, eps
        self.theta = float(vc["rope_parameters"].get("rope_theta", 100.0))

    def _rotary(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        """x [N, H, hd]: its first half turned by the patches' x, the second by y."""
        half = self.head_dim // 2
        inv = 1.0 / self.theta ** (np.arange(0, half, 2, dtype=np.float32) / half)
        turned = [apply_rotary(x[..., i * half : (i + 1) * half], pos[:, i], inv) for i in (0, 1)]
        return jnp.concatenate(turned, axis=-1)

    def __call__(self, x: jax.Array, pos: jax.Array, valid: jax.Array) -> jax.Array:
        """x [N, D], pos i32[N, 2], valid bool[N] (the keys every patch sees) -> [N, D]."""
        n, hd = x.shape[0], self.head_dim
        h = self.input_layernorm(x)
        q = self._rotary(self.q_norm(self.q_proj(h).reshape(n, self.heads, hd)), pos)
        k = self._rotary(self.k_norm(self.k_proj(h).reshape(n, self.kv_heads, hd)), pos)
        v = rms_normalize(self.v_proj(h).reshape(n, self.kv_heads, hd), self.eps).astype(h.dtype)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
        p = jax.nn.softmax(jnp.where(valid[None, None, :], s, -jnp.inf), axis=-1)
        attn = jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32)).astype(x.dtype)
        x = x + self.post_attention_layernorm(self.o_proj(attn.reshape(n, -1)))
        h = self.pre_feedforward_layernorm(x)
        mlp = jax.nn.gelu(self.gate_proj(h), approximate=True) * self.up_proj(h)
        return x + self.post_feedforward_layernorm(self.down_proj(mlp))


class Gemma4VisionEncoder(nnx.Module):
    """One image's patches -> its max_soft_tokens rows in the text hidden size."""

    def __init__(self, config: dict, *, dtype, rngs: nnx.Rngs):
        """config: the whole HF Gemma4Config as a dict (vision_config, text_config)."""
        vc = vision_settings(config)
        d, p = vc["hidden_size"], vc["patch_size"]
        self.dtype, self.d = dtype, d
        self.pool, self.eps = int(vc["pooling_kernel_size"]), float(vc["rms_norm_eps"])
        self.input_proj = Linear(3 * p * p, d, dtype=dtype, rngs=rngs)
        table = (2, int(vc["position_embedding_size"]), d)
        self.position_embedding_table = nnx.Param(jnp.zeros(table, dtype))
        self.layers = nnx.List(
            [_Layer(vc, dtype=dtype, rngs=rngs) for _ in range(vc["num_hidden_layers"])]
        )
        self.standardize = bool(vc["standardize"])
        if self.standardize:
            self.std_bias = nnx.Param(jnp.zeros((d,), jnp.float32))
            self.std_scale = nnx.Param(jnp.ones((d,), jnp.float32))
        text = int((config.get("text_config") or {})["hidden_size"])
        self.embedding_projection = Linear(d, text, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array, pixel_position_ids: jax.Array) -> jax.Array:
        """pixel_values f32[1, N, 3 p p] in [0, 1], pixel_position_ids i32[1, N, 2] ->
        [N / k**2, text hidden size] in `dtype`."""
        x, pos = pixel_values[0], pixel_position_ids[0]
        pad = jnp.all(pos == -1, axis=-1)  # [N]
        at = jnp.maximum(pos, 0)
        table = self.position_embedding_table[...]
        pe = table[0][at[:, 0]] + table[1][at[:, 1]]
        h = self.input_proj((2.0 * (x - 0.5)).astype(self.dtype))
        h = h + jnp.where(pad[:, None], 0, pe).astype(h.dtype)
        for layer in self.layers:
            h = layer(h, pos, ~pad)
        h = jnp.where(pad[:, None], 0, h)
        n, k = h.shape[0], self.pool
        out = n // (k * k)
        if out != n:  # each k x k square of patches (by position) to one token
            cols = (jnp.max(at[:, 0]) + 1) // k
            token = at[:, 0] // k + cols * (at[:, 1] // k)
            h = jax.ops.segment_sum(h.astype(jnp.float32) / (k * k), token, out).astype(h.dtype)
        h = h.astype(jnp.float32) * self.d**0.5
        if self.standardize:
            h = (h - self.std_bias[...]) * self.std_scale[...]
        h = rms_normalize(h.astype(self.dtype), self.eps).astype(self.dtype)
        return self.embedding_projection(h)

    @staticmethod
    def hf_weight(config: dict, path: tuple) -> HFWeight:
        """A parameter path -> its HF tensor: ('layers', 0, 'q_proj', 'linear', 'kernel') <-
        model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight transposed."""
        names = [str(p) for p in path]
        kernel = names[-1] == "kernel"
        build = np.transpose if kernel else None
        leaf = "weight" if kernel else names[-1]
        if names[0] == "embedding_projection":
            return HFWeight(("model.embed_vision.embedding_projection.weight",), build)
        tower = "model.vision_tower"
        if names[0] == "input_proj":
            return HFWeight((f"{tower}.patch_embedder.input_proj.weight",), build)
        if names[0] == "position_embedding_table":
            return HFWeight((f"{tower}.patch_embedder.position_embedding_table",))
        if names[0] in ("std_bias", "std_scale"):
            return HFWeight((f"{tower}.{names[0]}",))
        layer, module = f"{tower}.encoder.layers.{names[1]}", names[2]
        part = (
            "self_attn"
            if module in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
            else "mlp"
        )
        if module.endswith("layernorm"):
            return HFWeight((f"{layer}.{module}.weight",))
        rest = ".".join([*names[3:-1], leaf])
        return HFWeight((f"{layer}.{part}.{module}.{rest}",), build)
