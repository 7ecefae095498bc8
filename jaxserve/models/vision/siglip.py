"""Gemma 3's image path (HF `Gemma3Model.get_image_features`): a SigLIP vision tower (no class
token, `post_layernorm` on the last hidden state), then `Gemma3MultiModalProjector`: the
patches as a grid, average-pooled to `mm_tokens_per_image` tokens, Gemma RMSNorm
(x * (1 + w)) and one matmul into the text hidden size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.layers.norm import rms_normalize
from jaxserve.models.llama import HFWeight
from jaxserve.models.vision.vit import ViT, text_hidden_size, vision_config, vit_hf_weight

# HF `Gemma3Config`'s default tokens per image.
MM_TOKENS_PER_IMAGE = 256


def _settings(config: dict) -> tuple[dict, int, int]:
    """(vision config with defaults, patches a side, pooling window side)."""
    vcfg = vision_config(config, "siglip_vision_model")
    grid = int(vcfg["image_size"]) // int(vcfg["patch_size"])
    side = int((config.get("mm_tokens_per_image") or MM_TOKENS_PER_IMAGE) ** 0.5)
    if side < 1 or grid // side < 1:
        raise ValueError(f"mm_tokens_per_image does not fit a {grid}x{grid} patch grid")
    return vcfg, grid, grid // side


class GemmaRMSNorm(nnx.Module):
    """y = x / rms(x) * (1 + weight), in float32 (HF `Gemma3RMSNorm`; weight stored as HF's)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in x's dtype."""
        w = self.weight[...].astype(jnp.float32)
        return (rms_normalize(x, self.eps) * (1.0 + w)).astype(x.dtype)


class Gemma3Projector(nnx.Module):
    """[B, G * G, D_vision] patches -> [B, (G // k) ** 2, D_text]: AvgPool2d(k, stride k) over
    the grid, Gemma RMSNorm, @ mm_input_projection_weight [D_vision, D_text]."""

    def __init__(
        self, grid: int, window: int, d_in: int, d_out: int, eps: float, *, dtype, rngs: nnx.Rngs
    ):
        self.grid, self.window = grid, window
        init = nnx.initializers.normal(d_in**-0.5)
        self.mm_input_projection_weight = nnx.Param(init(rngs.params(), (d_in, d_out), dtype))
        self.mm_soft_emb_norm = GemmaRMSNorm(d_in, eps, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, G * G, D_vision] (patches row-major) -> [B, (G // k) ** 2, D_text], x's dtype."""
        b, _, d = x.shape
        g, k = self.grid, self.window
        out = g // k  # AvgPool2d floors: trailing rows / columns past out * k are dropped
        grid = x.reshape(b, g, g, d)[:, : out * k, : out * k].astype(jnp.float32)
        pooled = grid.reshape(b, out, k, out, k, d).mean(axis=(2, 4)).reshape(b, out * out, d)
        normed = self.mm_soft_emb_norm(pooled.astype(x.dtype))
        return normed @ self.mm_input_projection_weight[...].astype(x.dtype)


class Gemma3VisionEncoder(nnx.Module):
    """HF `Gemma3ForConditionalGeneration`'s image features: pixels -> text-space embeddings
    (the SigLIP tower's attention-pooling head, unused by Gemma 3, has no parameter here)."""

    def __init__(self, config: dict, *, dtype, rngs: nnx.Rngs):
        """config: the full HF Gemma3Config as a dict (vision_config, text_config,
        mm_tokens_per_image); missing fields take HF's defaults."""
        vcfg, grid, window = _settings(config)
        self.dtype = dtype
        self.vision_tower = ViT(
            vcfg,
            num_layers=int(vcfg["num_hidden_layers"]),
            class_token=False,
            patch_bias=True,
            pre_norm=False,
            post_norm=True,
            dtype=dtype,
            rngs=rngs,
        )
        self.multi_modal_projector = Gemma3Projector(
            grid,
            window,
            int(vcfg["hidden_size"]),
            text_hidden_size(config, "gemma3_text"),
            float(vcfg["layer_norm_eps"]),
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values f32[B, 3, H, W] (what the HF image processor gives) ->
        [B * tokens_per_image, text_hidden_size] in `dtype`."""
        x = self.multi_modal_projector(self.vision_tower(pixel_values))
        return x.reshape(-1, x.shape[-1]).astype(self.dtype)

    @staticmethod
    def hf_weight(config: dict, path: tuple) -> HFWeight:
        """A parameter path (as `nnx.state` gives it) -> its HF tensors, named as
        save_pretrained writes them (hub checkpoints say `vision_tower.vision_model.` for
        `vision_tower.`): ('vision_tower', 'layers', 0, 'mlp', 'fc1', 'kernel') <-
        vision_tower.encoder.layers.0.mlp.fc1.weight transposed;
        ('multi_modal_projector', 'mm_input_projection_weight') <- the same name, as is."""
        head, *rest = (str(p) for p in path)
        if head == "vision_tower":
            heads = int(_settings(config)[0]["num_attention_heads"])
            return vit_hf_weight(tuple(rest), "vision_tower.", heads)
        if head == "multi_modal_projector" and rest:
            return HFWeight((f"multi_modal_projector.{'.'.join(rest)}",))
        raise KeyError(f"no HF tensor for Gemma 3 vision parameter {path}")

    @staticmethod
    def tokens_per_image(config: dict) -> int:
        """Image embeddings each image yields: (patches a side // pooling window) ** 2, which
        is mm_tokens_per_image when that is a square dividing the grid."""
        _, grid, window = _settings(config)
        return (grid // window) ** 2
