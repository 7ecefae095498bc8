"""LLaVA's image path (HF `LlavaModel.get_image_features`): a CLIP vision tower (or a SigLIP
one, as some LLaVA checkpoints use), the hidden state(s) of `vision_feature_layer`, the class
token dropped ("default") or kept ("full"), then the two-layer `multi_modal_projector`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.layers.linear import Linear
from jaxserve.models.llama import HFWeight
from jaxserve.models.vision.vit import (
    ACTIVATIONS,
    ViT,
    check_activation,
    linear_hf_weight,
    text_hidden_size,
    vision_config,
    vit_hf_weight,
)

# HF `LlavaConfig` defaults for the top-level fields read here.
LLAVA_DEFAULTS = {
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "multimodal_projector_bias": True,
}
# The CLIP vision config HF builds when LlavaConfig has no vision_config (its init_kwargs).
LLAVA_VISION_ABSENT = {
    "intermediate_size": 4096,
    "hidden_size": 1024,
    "patch_size": 14,
    "image_size": 336,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
}
STRATEGIES = ("default", "full")


def _settings(config: dict) -> tuple[dict, tuple[int, ...], str]:
    """(vision config with defaults, the selected hidden states' indices in 0..num_layers,
    the select strategy)."""
    vcfg = vision_config(config, "clip_vision_model", LLAVA_VISION_ABSENT)
    layer = config.get("vision_feature_layer", LLAVA_DEFAULTS["vision_feature_layer"])
    layers = (layer,) if isinstance(layer, int) else tuple(layer)
    states = int(vcfg["num_hidden_layers"]) + 1  # HF's hidden_states: the embeddings + each layer
    if not layers or any(not -states <= i < states for i in layers):
        raise ValueError(f"vision_feature_layer {layer} is out of range for {states} hidden states")
    strategy = (
        config.get("vision_feature_select_strategy")
        or LLAVA_DEFAULTS["vision_feature_select_strategy"]
    )
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
    return vcfg, tuple(i % states for i in layers), strategy


class LlavaProjector(nnx.Module):
    """linear_2(act(linear_1(x))): [.., D_vision * n_layers] -> [.., D_text]."""

    def __init__(self, d_in: int, d_out: int, act: str, bias: bool, *, dtype, rngs: nnx.Rngs):
        self.act = check_activation(act)
        self.linear_1 = Linear(d_in, d_out, bias=bias, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear(d_out, d_out, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., d_in] -> [..., d_out]."""
        return self.linear_2(ACTIVATIONS[self.act](self.linear_1(x)))


class LlavaVisionEncoder(nnx.Module):
    """HF `LlavaForConditionalGeneration`'s image features: pixels -> text-space embeddings.

    Only the encoder layers up to the deepest selected `vision_feature_layer` are built (and
    loaded); CLIP's `post_layernorm` is never used by LLaVA and has no parameter here.
    """

    def __init__(self, config: dict, *, dtype, rngs: nnx.Rngs):
        """config: the full HF LlavaConfig as a dict (vision_config, text_config, top-level
        vision_feature_layer, vision_feature_select_strategy, projector_hidden_act,
        multimodal_projector_bias); missing fields take HF's defaults."""
        vcfg, self.feature_layers, self.strategy = _settings(config)
        self.dtype = dtype
        clip = vcfg["model_type"] == "clip_vision_model"
        self.vision_tower = ViT(
            vcfg,
            num_layers=max(self.feature_layers),
            class_token=clip,
            patch_bias=not clip,
            pre_norm=clip,
            post_norm=False,
            dtype=dtype,
            rngs=rngs,
        )
        d_in = int(vcfg["hidden_size"]) * len(self.feature_layers)
        act = config.get("projector_hidden_act") or LLAVA_DEFAULTS["projector_hidden_act"]
        bias = config.get("multimodal_projector_bias", LLAVA_DEFAULTS["multimodal_projector_bias"])
        self.multi_modal_projector = LlavaProjector(
            d_in, text_hidden_size(config, "llama"), act, bool(bias), dtype=dtype, rngs=rngs
        )

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values f32[B, 3, H, W] (what the HF image processor gives) ->
        [B * tokens_per_image, text_hidden_size] in `dtype`."""
        states = self.vision_tower.hidden_states(pixel_values, self.feature_layers)
        if self.strategy == "default":  # HF drops the first token, the class token
            states = [s[:, 1:] for s in states]
        x = self.multi_modal_projector(jnp.concatenate(states, axis=-1))  # [B, T, D_text]
        return x.reshape(-1, x.shape[-1]).astype(self.dtype)

    @staticmethod
    def hf_weight(config: dict, path: tuple) -> HFWeight:
        """A parameter path (as `nnx.state` gives it) -> its HF tensors, named as
        save_pretrained writes them (hub checkpoints say `vision_tower.vision_model.` for
        `vision_tower.`): ('vision_tower', 'layers', 0, 'self_attn', 'qkv_proj', 'kernel') <-
        vision_tower.encoder.layers.0.self_attn.{q,k,v}_proj.weight fused and transposed;
        ('multi_modal_projector', 'linear_1', 'kernel') <- multi_modal_projector.linear_1.weight
        transposed."""
        head, *rest = (str(p) for p in path)
        if head == "vision_tower":
            heads = int(_settings(config)[0]["num_attention_heads"])
            return vit_hf_weight(tuple(rest), "vision_tower.", heads)
        if head == "multi_modal_projector" and len(rest) == 2:
            return linear_hf_weight(f"multi_modal_projector.{rest[0]}", rest[1])
        raise KeyError(f"no HF tensor for LLaVA vision parameter {path}")

    @staticmethod
    def tokens_per_image(config: dict) -> int:
        """Image embeddings each image yields: the patches (+ the class token under "full";
        a SigLIP tower under "default" loses a patch, as HF drops the first token blindly)."""
        vcfg, _, strategy = _settings(config)
        grid = int(vcfg["image_size"]) // int(vcfg["patch_size"])
        tokens = grid * grid + int(vcfg["model_type"] == "clip_vision_model")
        return tokens - int(strategy == "default")
