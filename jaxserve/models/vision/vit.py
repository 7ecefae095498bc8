"""The ViT pieces CLIP's and SigLIP's vision towers share (HF `CLIPVisionModel`,
`SiglipVisionModel`): patch embedding as a matmul over flattened patches, an optional class
token, learned position embeddings, pre-LN encoder layers (LayerNorm, biased multi-head
attention, biased MLP) and their HF tensor names.

Shapes: B images, C channels, P patch side, G = image_size // P patches a side, N = G * G
patches (+ 1 with a class token), D hidden size, H heads, hd = D / H.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.linear import Linear
from jaxserve.models.llama import HFWeight

# HF `CLIPVisionConfig` / `SiglipVisionConfig` class defaults for the fields read here.
CLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
SIGLIP_VISION_DEFAULTS = {
    **CLIP_VISION_DEFAULTS,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
VISION_DEFAULTS = {
    "clip_vision_model": CLIP_VISION_DEFAULTS,
    "siglip_vision_model": SIGLIP_VISION_DEFAULTS,
}
# HF text config classes' default hidden_size, for a text_config that leaves it out.
TEXT_HIDDEN_DEFAULTS = {"llama": 4096, "mistral": 4096, "qwen2": 4096, "gemma3_text": 2304}
# Queries per block of `full_attention` (bounds the f32 score tensor to [B, H, block, N]).
ATTN_QUERY_BLOCK = 1024


def _quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


# HF ACT2FN names -> the function.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "quick_gelu": _quick_gelu,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def check_activation(name: str) -> str:
    """name, or ValueError when `ACTIVATIONS` lacks it."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (known: {sorted(ACTIVATIONS)})")
    return name


def vision_config(config: dict, default_type: str, absent: dict | None = None) -> dict:
    """The VLM config's "vision_config" with HF's class defaults filled in (by its model_type,
    else `default_type`); `absent`: the extra fields HF uses when vision_config is missing
    (LLaVA's `SubConfigSpec.init_kwargs`)."""
    given = config.get("vision_config")
    model_type = (given or {}).get("model_type") or default_type
    if model_type not in VISION_DEFAULTS:
        raise ValueError(
            f"unsupported vision tower {model_type!r} (known: {sorted(VISION_DEFAULTS)})"
        )
    out = {**VISION_DEFAULTS[model_type], "model_type": model_type}
    out.update(given if given is not None else absent or {})
    return out


def text_hidden_size(config: dict, default_type: str) -> int:
    """The VLM's text hidden size: text_config's hidden_size, else its class default."""
    text = config.get("text_config") or {}
    if "hidden_size" in text:
        return int(text["hidden_size"])
    model_type = text.get("model_type") or default_type
    if model_type not in TEXT_HIDDEN_DEFAULTS:
        raise ValueError(f"text_config ({model_type!r}) gives no hidden_size")
    return TEXT_HIDDEN_DEFAULTS[model_type]


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm: (x - mean) / sqrt(var + eps) * weight + bias, in float32."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in x's dtype."""
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)


def full_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float, block: int = ATTN_QUERY_BLOCK
) -> jax.Array:
    """Bidirectional softmax attention, scores and softmax in float32.

    q, k, v: [B, N, H, hd] -> [B, N, H, hd] in v's dtype. Queries go `block` at a time (a
    `lax.map`, padded to a whole block) so a long sequence (Gemma 3's 4096 patches) never holds
    all of its [B, H, N, N] scores at once.
    """

    def attend(qb: jax.Array) -> jax.Array:
        s = jnp.einsum("bqhd,bkhd->bhqk", qb, k, preferred_element_type=jnp.float32) * scale
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    b, n, h, d = q.shape
    if n <= block:
        return attend(q)
    blocks = -(-n // block)
    qp = jnp.pad(q, ((0, 0), (0, blocks * block - n), (0, 0), (0, 0)))
    out = jax.lax.map(attend, qp.reshape(b, blocks, block, h, d).swapaxes(0, 1))
    return out.swapaxes(0, 1).reshape(b, blocks * block, h, d)[:, :n]


class ViTAttention(nnx.Module):
    """Multi-head self-attention with biases; q, k, v fused in one [D, 3D] projection whose
    columns go head by head (each head's q, k, v side by side: `fuse_heads`), so a
    tensor-parallel split of the columns gives each device whole heads."""

    def __init__(self, dim: int, heads: int, *, dtype, rngs: nnx.Rngs):
        if dim % heads:
            raise ValueError(f"hidden size {dim} is not a multiple of the {heads} heads")
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv_proj = Linear(dim, 3 * dim, bias=True, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, N, D] -> [B, N, D]."""
        b, n, dim = x.shape
        qkv = self.qkv_proj(x).reshape(b, n, self.heads, 3, dim // self.heads)
        out = full_attention(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], self.scale)
        return self.out_proj(out.reshape(b, n, dim))


class ViTMLP(nnx.Module):
    """fc2(act(fc1(x))), both biased."""

    def __init__(self, dim: int, hidden: int, act: str, *, dtype, rngs: nnx.Rngs):
        self.act = check_activation(act)
        self.fc1 = Linear(dim, hidden, bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(hidden, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, N, D] -> [B, N, D]."""
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class ViTLayer(nnx.Module):
    """Pre-LN encoder layer: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, cfg: dict, *, dtype, rngs: nnx.Rngs):
        dim, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.layer_norm1 = LayerNorm(dim, eps, dtype=dtype)
        self.self_attn = ViTAttention(dim, cfg["num_attention_heads"], dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(dim, eps, dtype=dtype)
        self.mlp = ViTMLP(dim, cfg["intermediate_size"], cfg["hidden_act"], dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, N, D] -> [B, N, D]."""
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ViTEmbeddings(nnx.Module):
    """Patches (a Conv2d of stride P as a matmul) + optional class token + position table."""

    def __init__(self, cfg: dict, *, class_token: bool, patch_bias: bool, dtype, rngs: nnx.Rngs):
        dim, self.patch = cfg["hidden_size"], int(cfg["patch_size"])
        self.grid = int(cfg["image_size"]) // self.patch
        d_in = int(cfg["num_channels"]) * self.patch * self.patch
        self.patch_embedding = Linear(d_in, dim, bias=patch_bias, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.class_embedding = (
            nnx.Param(init(rngs.params(), (dim,), dtype)) if class_token else None
        )
        positions = self.grid * self.grid + int(class_token)
        self.position_embedding = nnx.Param(init(rngs.params(), (positions, dim), dtype))

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, C, G * P, G * P] -> [B, N, D] in the parameters' dtype."""
        b, c, h, w = pixel_values.shape
        p, g = self.patch, self.grid
        if h != g * p or w != g * p:
            raise ValueError(f"image {h}x{w} is not the model's {g * p}x{g * p}")
        x = pixel_values.astype(self.position_embedding[...].dtype)
        # [B, C, G, P, G, P] -> [B, G, G, C, P, P]: each patch flattened as the conv weight is.
        x = x.reshape(b, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
        x = self.patch_embedding(x)
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding[...], (b, 1, x.shape[-1]))
            x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
        return x + self.position_embedding[...]


class ViT(nnx.Module):
    """A CLIP / SigLIP vision tower's first `num_layers` encoder layers.

    CLIP: class token, no patch bias, `pre_layrnorm`. SigLIP: no class token, patch bias,
    `post_layernorm` (on the last hidden state). Parameter paths mirror HF's module names
    (`layers` stands for HF's `encoder.layers`; see `vit_hf_weight`).
    """

    def __init__(
        self,
        cfg: dict,
        *,
        num_layers: int,
        class_token: bool,
        patch_bias: bool,
        pre_norm: bool,
        post_norm: bool,
        dtype,
        rngs: nnx.Rngs,
    ):
        dim, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.embeddings = ViTEmbeddings(
            cfg, class_token=class_token, patch_bias=patch_bias, dtype=dtype, rngs=rngs
        )
        self.pre_layrnorm = LayerNorm(dim, eps, dtype=dtype) if pre_norm else None
        self.layers = nnx.List([ViTLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(num_layers)])
        self.post_layernorm = LayerNorm(dim, eps, dtype=dtype) if post_norm else None

    def hidden_states(self, pixel_values: jax.Array, select: Sequence[int]) -> list[jax.Array]:
        """pixel_values f32[B, C, H, W] -> the hidden states [B, N, D] numbered as HF's
        `hidden_states` (0: the first layer's input, i: layer i's output), for each index in
        `select` (each in 0..num_layers); no post_layernorm."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for i in range(max(select)):
            states.append(self.layers[i](states[-1]))
        return [states[i] for i in select]

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values f32[B, C, H, W] -> the last hidden state [B, N, D] (post_layernorm'd
        when the tower has one: HF's `last_hidden_state`)."""
        (x,) = self.hidden_states(pixel_values, [len(self.layers)])
        return x if self.post_layernorm is None else self.post_layernorm(x)


def _transpose(w: np.ndarray) -> np.ndarray:
    return np.transpose(w)


def fuse_heads(qkv: np.ndarray, heads: int) -> np.ndarray:
    """HF's q, k, v stacked [3 * H * hd, ...] (weights [out, in] or biases) -> [H * 3 * hd,
    ...]: head by head, each head's q, k and v rows side by side."""
    rest = qkv.shape[1:]
    return qkv.reshape(3, heads, -1, *rest).swapaxes(0, 1).reshape(-1, *rest)


def _fuse_qkv_kernel(heads: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    return fuse_heads(np.concatenate([q, k, v], axis=0), heads).T  # [D, 3D]


def _fuse_qkv_bias(heads: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    return fuse_heads(np.concatenate([q, k, v], axis=0), heads)


def _patch_kernel(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], -1).T  # conv [D, C, P, P] -> [C * P * P, D]


def linear_hf_weight(name: str, leaf: str) -> HFWeight:
    """A biased nn.Linear `name`: our kernel [in, out] <- `name.weight` [out, in] transposed,
    bias <- `name.bias`."""
    if leaf == "kernel":
        return HFWeight((f"{name}.weight",), _transpose)
    return HFWeight((f"{name}.{leaf}",))


def vit_hf_weight(path: tuple, prefix: str, heads: int) -> HFWeight:
    """A `ViT` parameter path (e.g. ('layers', 0, 'self_attn', 'qkv_proj', 'kernel')) -> its HF
    tensors under `prefix` (e.g. "vision_tower."), as transformers' save_pretrained names them:
    `{prefix}encoder.layers.0.self_attn.{q,k,v}_proj.weight`, fused head by head (`heads`)."""
    *mods, leaf = (str(p) for p in path)
    if mods[0] == "layers":
        base = f"{prefix}encoder.layers.{mods[1]}.{'.'.join(mods[2:])}"
        if mods[-1] == "qkv_proj":
            base = base.removesuffix("qkv_proj")
            suffix = "weight" if leaf == "kernel" else "bias"
            names = tuple(f"{base}{p}_proj.{suffix}" for p in "qkv")
            build = _fuse_qkv_kernel if leaf == "kernel" else _fuse_qkv_bias
            return HFWeight(names, functools.partial(build, heads))
        if mods[-1] in ("out_proj", "fc1", "fc2"):
            return linear_hf_weight(base, leaf)
        return HFWeight((f"{base}.{leaf}",))  # layer_norm{1,2}.{weight,bias}
    if mods == ["embeddings", "patch_embedding"]:
        if leaf == "kernel":
            return HFWeight((f"{prefix}embeddings.patch_embedding.weight",), _patch_kernel)
        return HFWeight((f"{prefix}embeddings.patch_embedding.bias",))
    if mods == ["embeddings"] and leaf == "class_embedding":
        return HFWeight((f"{prefix}embeddings.class_embedding",))
    if mods == ["embeddings"] and leaf == "position_embedding":
        return HFWeight((f"{prefix}embeddings.position_embedding.weight",))
    if mods and mods[0] in ("pre_layrnorm", "post_layernorm"):
        return HFWeight((f"{prefix}{mods[0]}.{leaf}",))
    raise KeyError(f"no HF tensor for vision tower parameter {path}")
