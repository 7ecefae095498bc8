"""Vision-language models: a language model of the Llama family whose image placeholder
tokens take an image encoder's outputs (worker/encoder_runner.py runs the encoder and fills
the encoder cache; `LlamaForCausalLM.__call__` reads it through `mm_rows`).

A model here adds to its language model:
  vision            the image encoder (models/vision/), parameters under ("vision", ...),
                    replicated over the mesh
  encode(**inputs)  one padded image's inputs -> [tokens, D] text-space embeddings
  encoder_buckets   the image shapes compiled at start-up: name -> (tokens, example inputs)
  encoder_bucket    one image's processed arrays -> its bucket (the engine's check at add)
  encoder_inputs    one image's processed arrays -> (its bucket, the padded inputs)
and the HF tensor names of its checkpoints (`checkpoint_aliases`: other prefixes the same
tensors are saved under, tried in order when a name is missing).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.gemma import GemmaForCausalLM
from jaxserve.models.gemma4 import Gemma4ForCausalLM
from jaxserve.models.llama import HFWeight, LlamaForCausalLM
from jaxserve.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxserve.models.vision.clip import LlavaVisionEncoder
from jaxserve.models.vision.gemma4_vision import SOFT_TOKENS, Gemma4VisionEncoder, vision_settings
from jaxserve.models.vision.qwen2_5_vl import Qwen2_5_VLVisionEncoder, vision_config
from jaxserve.models.vision.qwen3_5_vision import Qwen3_5VisionEncoder, Qwen3VLVisionEncoder
from jaxserve.models.vision.siglip import Gemma3VisionEncoder
from jaxserve.models.weight_maps import compose, fused_experts
from jaxserve.multimodal.inputs import MultiModalFeature
from jaxserve.multimodal.mrope import mrope_positions


class _VisionLanguageModel(LlamaForCausalLM):
    vision_cls: type
    eagle_target = False  # (image placeholders: no EAGLE path for them)
    # The language model's HF names: language_weight's (as the language model is saved alone)
    # with "model." -> lm_prefix
    lm_prefix = "model."
    head_name = "lm_head.weight"
    checkpoint_aliases: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        super().__init__(config, kv_replicas=kv_replicas, rngs=rngs)
        mm = config.hf_config.multimodal_config
        self.vision = self.vision_cls(mm, dtype=config.dtype, rngs=rngs)

    language_weight = LlamaForCausalLM.hf_weight

    @classmethod
    def hf_weight(cls, config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        if str(path[0]) == "vision":
            return cls.vision_cls.hf_weight(config.hf_config.multimodal_config, path[1:])
        weight = cls.language_weight(config, path, kv_replicas)
        names = tuple(
            cls.head_name if n == "lm_head.weight" else cls.lm_prefix + n.removeprefix("model.")
            for n in weight.names
        )
        return HFWeight(names, weight.build)


class _FixedSizeImages(_VisionLanguageModel):
    """A tower whose processor resizes every image to one square size: one encoder shape,
    pixel_values f32[1, 3, S, S] in, the tower's tokens per image out."""

    default_image_size: int

    def encode(self, pixel_values):
        """pixel_values f32[1, 3, S, S] -> [tokens_per_image, D]."""
        return self.vision(pixel_values)

    @classmethod
    def encoder_buckets(cls, mm_config: dict, max_tokens: int) -> dict:
        size = int((mm_config.get("vision_config") or {}).get("image_size", cls.default_image_size))
        pixels = np.zeros((1, 3, size, size), np.float32)
        return {size: (cls.vision_cls.tokens_per_image(mm_config), {"pixel_values": pixels})}

    @staticmethod
    def encoder_bucket(mm_config: dict, data: dict, buckets: dict):
        """The bucket an image's processed arrays run in (ValueError: none)."""
        shape = np.shape(data["pixel_values"])
        if len(shape) != 4 or shape[0] != 1 or shape[2] not in buckets or shape[3] != shape[2]:
            raise ValueError(f"image pixel_values of shape {shape} fit no encoder shape")
        return shape[2]

    @classmethod
    def encoder_inputs(cls, mm_config: dict, data: dict, buckets: dict) -> tuple:
        name = cls.encoder_bucket(mm_config, data, buckets)
        return name, {"pixel_values": np.asarray(data["pixel_values"], np.float32)}


class LlavaForConditionalGeneration(_FixedSizeImages):
    """LLaVA-1.5 style: a CLIP (or SigLIP) tower, a two-layer projector, a Llama / Mistral /
    Vicuna language model; each `<image>` token of the prompt becomes the image's tokens."""

    vision_cls = LlavaVisionEncoder
    default_image_size = 336
    lm_prefix = "language_model.model."
    head_name = "language_model.lm_head.weight"
    checkpoint_aliases = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "vision_tower.vision_model."),
        ("vision_tower.", "model.vision_tower."),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )


class Gemma3ForConditionalGeneration(_FixedSizeImages, GemmaForCausalLM):
    """Gemma 3 4B / 12B / 27B: a SigLIP tower (896 px), average-pooled to 256 tokens, the
    soft-embedding norm and projection; Gemma 3's language model, in which one image's tokens
    attend to each other both ways (`bidirectional_images`: an image runs in one prefill
    chunk, and the attention's `causal_ext` lets each of its tokens see the image's end)."""

    vision_cls = Gemma3VisionEncoder
    default_image_size = 896
    bidirectional_images = True
    lm_prefix = LlavaForConditionalGeneration.lm_prefix
    head_name = LlavaForConditionalGeneration.head_name
    checkpoint_aliases = LlavaForConditionalGeneration.checkpoint_aliases


class Gemma4ForConditionalGeneration(_VisionLanguageModel, Gemma4ForCausalLM):
    """Gemma 4 with images: its vision tower (models/vision/gemma4_vision.py) at each image's
    aspect ratio, one encoder shape per soft-token budget the processor takes (its
    `max_soft_tokens`, 280 unless set: the padded patches of that many tokens); Gemma 4's
    language model, where an image's tokens see each other both ways in the sliding layers
    (it runs in one prefill chunk, as Gemma 3's)."""

    vision_cls = Gemma4VisionEncoder
    bidirectional_images = True
    lm_prefix = "model.language_model."
    language_weight = Gemma4ForCausalLM.hf_weight

    def encode(self, pixel_values, pixel_position_ids):
        """One image's padded patches f32[1, N, 3 p p] and positions i32[1, N, 2] ->
        [N / k**2, D]."""
        return self.vision(pixel_values, pixel_position_ids)

    @staticmethod
    def image_token_cap(preprocessor: dict) -> int | None:
        """The processor's largest image: its max_soft_tokens."""
        return int(preprocessor.get("max_soft_tokens") or 280)

    @classmethod
    def encoder_buckets(cls, mm_config: dict, max_tokens: int) -> dict:
        """Every soft-token budget up to max_tokens (at least the smallest): its padded
        patches."""
        vc = vision_settings(mm_config)
        unit, width = vc["pooling_kernel_size"] ** 2, 3 * vc["patch_size"] ** 2
        out = {}
        for tokens in [t for t in SOFT_TOKENS if t <= max_tokens] or SOFT_TOKENS[:1]:
            n = tokens * unit
            data = {
                "pixel_values": np.zeros((1, n, width), np.float32),
                "pixel_position_ids": np.full((1, n, 2), -1, np.int32),
            }
            out[tokens] = (tokens, data)
        return out

    @staticmethod
    def encoder_bucket(mm_config: dict, data: dict, buckets: dict) -> int:
        """The image's soft-token budget (ValueError when no shape was compiled for it)."""
        unit = vision_settings(mm_config)["pooling_kernel_size"] ** 2
        shape = np.shape(data["pixel_values"])
        tokens = shape[1] // unit if len(shape) == 3 and shape[0] == 1 else None
        if tokens not in buckets:
            raise ValueError(
                f"image pixel_values of shape {shape} fit no encoder shape (max_soft_tokens "
                f"of {sorted(buckets)})"
            )
        return tokens

    @classmethod
    def encoder_inputs(cls, mm_config: dict, data: dict, buckets: dict) -> tuple:
        name = cls.encoder_bucket(mm_config, data, buckets)
        return name, {
            "pixel_values": np.asarray(data["pixel_values"], np.float32),
            "pixel_position_ids": np.asarray(data["image_position_ids"], np.int32),
        }


class Qwen2_5_VLForConditionalGeneration(_VisionLanguageModel):
    """Qwen2.5-VL: a windowed-attention ViT at the image's own resolution (its patches padded
    to a bucket), merged 2x2 into tokens; a Qwen2 language model with M-RoPE (three position
    axes for image tokens, `multimodal/mrope.py`)."""

    vision_cls = Qwen2_5_VLVisionEncoder
    uses_mrope = True
    checkpoint_aliases = (
        ("model.", "model.language_model."),
        ("visual.", "model.visual."),
    )

    @staticmethod
    def image_token_cap(preprocessor: dict) -> int | None:
        """The most tokens the image processor makes of one image: its max_pixels (HF's
        `size.longest_edge`, or the older `max_pixels`) over one token's 28x28 pixels."""
        size = preprocessor.get("size") or {}
        pixels = preprocessor.get("max_pixels") or size.get("longest_edge")
        patch = preprocessor.get("patch_size", 14) * preprocessor.get("merge_size", 2)
        return int(pixels) // patch**2 if pixels else None

    def encode(self, **inputs):
        """`Qwen2_5_VLVisionEncoder.prepare`'s arrays -> [patches / merge**2, D]."""
        return self.vision(**inputs)

    @classmethod
    def encoder_buckets(cls, mm_config: dict, max_tokens: int) -> dict:
        """Patch counts up to what one step's tokens can take (merge**2 patches a token)."""
        vc = cls.vision_cls.config_of(mm_config)
        merge = vc["spatial_merge_size"]
        unit = merge**2
        patch_dim = 3 * vc["temporal_patch_size"] * vc["patch_size"] ** 2
        out = {}
        for n in Qwen2_5_VLVisionEncoder.patch_buckets(mm_config, max_tokens * unit):
            grid = np.array([[1, merge, n // merge]])
            pixels = np.zeros((n, patch_dim), np.float32)
            out[n] = (n // unit, cls.vision_cls.prepare(mm_config, pixels, grid, n))
        return out

    @staticmethod
    def encoder_bucket(mm_config: dict, data: dict, buckets: dict) -> int:
        """The smallest patch bucket holding the image (ValueError: none)."""
        patches = int(np.prod(np.asarray(data["image_grid_thw"]).reshape(-1, 3), axis=1).sum())
        fits = [n for n in buckets if n >= patches]
        if not fits:
            raise ValueError(
                f"an image of {patches} patches is larger than the largest encoder shape "
                f"({max(buckets)} patches); pass smaller max_pixels in mm_processor_kwargs"
            )
        return min(fits)

    @classmethod
    def encoder_inputs(cls, mm_config: dict, data: dict, buckets: dict) -> tuple:
        n = cls.encoder_bucket(mm_config, data, buckets)
        grid = np.asarray(data["image_grid_thw"]).reshape(-1, 3)
        return n, cls.vision_cls.prepare(mm_config, data["pixel_values"], grid, n)

    @staticmethod
    def mrope_positions(
        mm_config: dict, prompt_ids: list[int], features: list[MultiModalFeature]
    ) -> tuple[np.ndarray, int]:
        """The prompt's i32[3, P] M-RoPE positions and the delta of the tokens after it."""
        grids = [np.asarray(f.data["image_grid_thw"]).reshape(3) for f in features]
        return mrope_positions(
            prompt_ids,
            np.array(grids).reshape(-1, 3) if grids else None,
            image_token_id=int(mm_config["image_token_id"]),
            spatial_merge_size=vision_config(mm_config)["spatial_merge_size"],
        )


class Qwen3_5ForConditionalGeneration(Qwen2_5_VLForConditionalGeneration, Qwen3_5ForCausalLM):
    """Qwen3.5 (dense and MoE) with images: its vision tower (models/vision/qwen3_5_vision.py:
    whole-frame attention, learned position embeddings, no windows) on Qwen2.5-VL's patch
    buckets and M-RoPE positions, the rotary interleaved over the axes (RopeConfig.
    mrope_interleaved); the hybrid language model (models/qwen3_next.py's forward)."""

    vision_cls = Qwen3_5VisionEncoder
    checkpoint_aliases = ()
    lm_prefix = "model.language_model."
    language_weight = Qwen3_5ForCausalLM.hf_weight


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL (dense): Qwen3.5's tower with DeepStack (its further features added to the
    image tokens' hidden states after the first language layers: `deepstack_layers`), a
    Qwen3 language model with interleaved M-RoPE."""

    vision_cls = Qwen3VLVisionEncoder
    checkpoint_aliases = ()
    lm_prefix = "model.language_model."

    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        super().__init__(config, kv_replicas=kv_replicas, rngs=rngs)
        self.deepstack_layers = self.vision_cls.num_deepstack(config.hf_config.multimodal_config)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: Qwen3-VL with Qwen3-MoE's softmax-routed experts, stored fused."""

    language_weight = compose(fused_experts("mlp"))
