"""A prompt's images -> the features the engine core runs: the model's HF image processor
(its PIL backend: the fast ones need torchvision), each image's placeholder token expanded to
the image's tokens, and each image's content hash.

Runs in the frontend process (the input processor), never in the engine core.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.multimodal.inputs import MultiModalFeature

# The architectures whose images this module processes (transformers_utils.config's
# MULTIMODAL_MODELS) -> the config field naming the image placeholder token.
IMAGE_TOKEN_FIELDS = {
    "LlavaForConditionalGeneration": "image_token_index",
    "Qwen2_5_VLForConditionalGeneration": "image_token_id",
    "Gemma3ForConditionalGeneration": "image_token_index",
    "Gemma4ForConditionalGeneration": "image_token_id",
    "Qwen3_5ForConditionalGeneration": "image_token_id",
    "Qwen3_5MoeForConditionalGeneration": "image_token_id",
    "Qwen3VLForConditionalGeneration": "image_token_id",
    "Qwen3VLMoeForConditionalGeneration": "image_token_id",
}
# Where the prompt marks an image with another token, expanded around the image's tokens:
# Gemma 3's `<start_of_image>` becomes "\n\n<start_of_image>" + its tokens +
# "<end_of_image>\n\n" (HF's Gemma3Processor.full_image_sequence).
MARKER_FIELDS = {"Gemma3ForConditionalGeneration": ("boi_token_index", "eoi_token_index")}
# Where the image token once per image becomes <begin> + the image's tokens + <end> (HF's
# Gemma4Processor.replace_image_token).
WRAP_FIELDS = {"Gemma4ForConditionalGeneration": ("boi_token_id", "eoi_token_id")}


def load_image_processor(model_dir: str | Path) -> Any:
    """The HF image processor named by the model's preprocessor_config.json, PIL backend
    (`<Name>Pil` in transformers >= 5, the plain class before it)."""

    path = Path(model_dir) / "preprocessor_config.json"
    try:
        name = json.loads(path.read_text())["image_processor_type"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the image processor of {model_dir}: {e}") from None
    cls = pil_image_processor_class(name)
    if cls is None:
        raise ValueError(f"{path}: image processor {name!r} is not in transformers")
    return cls.from_pretrained(model_dir)


def pil_image_processor_class(name: str) -> Any:
    """transformers' PIL-backed class of image processor `name` (`<Name>Pil` in
    transformers >= 5, the plain class before it), or None."""
    import transformers

    name = name.removesuffix("Fast")
    return getattr(transformers, f"{name}Pil", None) or getattr(transformers, name, None)


def content_hash(image: Any, kwargs: dict) -> str:
    """sha256 over an image's pixels (mode, size, bytes) and the processor options it is
    processed with: what its processed arrays are a function of (the model's processor is
    fixed). The decoded image is ~8x smaller than its float32 pixel values."""
    h = hashlib.sha256()
    options = json.dumps(kwargs, sort_keys=True, default=str)
    h.update(f"{image.mode}:{image.size}:{options}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class MultiModalProcessor:
    """One model's image processing: `process(ids, images)` -> (expanded ids, features)."""

    def __init__(
        self, architecture: str, multimodal_config: dict, model_dir: str | Path, tokenizer=None
    ):
        if architecture not in IMAGE_TOKEN_FIELDS:
            raise ValueError(f"{architecture} takes no images")
        self.architecture = architecture
        self.config = multimodal_config
        self.image_token_id = int(multimodal_config[IMAGE_TOKEN_FIELDS[architecture]])
        self.marker_id, self.end_id = self.image_token_id, None  # the token once per image
        self.newlines: list[int] = []
        self.marker_text = self.end_text = None
        if architecture in MARKER_FIELDS:
            begin, end = (int(multimodal_config[f]) for f in MARKER_FIELDS[architecture])
            self.marker_id, self.end_id = begin, end
            if tokenizer is not None:
                self.marker_text, self.end_text = tokenizer.convert_ids_to_tokens([begin, end])
                self.newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        self.wrap = tuple(int(multimodal_config[f]) for f in WRAP_FIELDS.get(architecture, ()))
        self.model_dir = model_dir

    @functools.cached_property
    def image_processor(self) -> Any:
        """The HF image processor, read on first use (rendering a prompt needs none)."""
        return load_image_processor(self.model_dir)

    def expand_text(self, text: str) -> str:
        """A text prompt with Gemma 3's image marker expanded as HF's processor does before
        tokenizing (so the newlines around it merge with the text as HF's do); the image's
        own tokens go in when the ids are processed."""
        if self.marker_text is None:
            return text
        return text.replace(self.marker_text, f"\n\n{self.marker_text}{self.end_text}\n\n")

    def process(
        self, prompt_ids: list[int], images: list[Any], processor_kwargs: dict | None = None
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """prompt_ids hold the image token once per image, in order; each becomes the
        image's tokens. processor_kwargs: the image processor's own options
        (`mm_processor_kwargs`, e.g. Qwen2.5-VL's min_pixels / max_pixels)."""
        marks = [i for i, t in enumerate(prompt_ids) if t == self.marker_id]
        if len(marks) != len(images):
            raise ValueError(
                f"the prompt has {len(marks)} image placeholder(s) (token "
                f"{self.marker_id}) but {len(images)} image(s) were given"
            )
        ids: list[int] = []
        features = []
        prev = 0
        for mark, image in zip(marks, images, strict=True):
            image = _as_image(image)
            data = self._pixels(image, processor_kwargs or {})
            n = self._num_tokens(data)
            ids.extend(prompt_ids[prev:mark])
            closed = True
            if self.end_id is not None:  # Gemma 3: <boi> tokens <eoi>
                closed = mark + 1 < len(prompt_ids) and prompt_ids[mark + 1] == self.end_id
                ids.extend(([] if closed else self.newlines) + [self.marker_id])
            if self.wrap:  # Gemma 4: <boi> tokens <eoi>
                ids.append(self.wrap[0])
            ident = content_hash(image, processor_kwargs or {})
            features.append(MultiModalFeature("image", ident, len(ids), n, data))
            ids.extend([self.image_token_id] * n)
            if not closed:  # ids without the text expansion: the whole sequence here
                ids.extend([self.end_id, *self.newlines])
            ids.extend(self.wrap[1:])
            prev = mark + 1
        ids.extend(prompt_ids[prev:])
        return ids, features

    def _pixels(self, image: Any, kwargs: dict) -> dict[str, np.ndarray]:
        try:
            out = self.image_processor(images=[image], return_tensors="np", **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot process the image: {e}") from None
        data = {k: np.asarray(v) for k, v in out.items() if k != "num_crops"}
        data["pixel_values"] = data["pixel_values"].astype(np.float32, copy=False)
        return data

    def _num_tokens(self, data: dict[str, np.ndarray]) -> int:
        """The encoder output rows of one image: its placeholder tokens."""
        if "num_soft_tokens_per_image" in data:  # Gemma 4: its patches over k**2
            return int(np.asarray(data["num_soft_tokens_per_image"]).reshape(-1)[0])
        if "image_grid_thw" in data:  # Qwen2.5-VL: patches over merge**2
            merge = self.config.get("vision_config", {}).get("spatial_merge_size", 2)
            return int(np.prod(data["image_grid_thw"][0])) // merge**2
        if "mm_tokens_per_image" in self.config or self.end_id is not None:  # Gemma 3
            return int(self.config.get("mm_tokens_per_image", 256))
        vision = self.config.get("vision_config", {})
        n = (vision.get("image_size", 224) // vision.get("patch_size", 14)) ** 2
        strategy = self.config.get("vision_feature_select_strategy", "default")
        return n + (strategy == "full")


def _as_image(image: Any) -> Any:
    """A PIL image as it is (its processor converts it to RGB as HF's does); anything else:
    ValueError."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
    return image
