"""Tiny random-weight vision-language models saved with transformers' own classes (config,
weights, tokenizer with the image tokens, image processor), and test images drawn with
Pillow: what the multimodal tests compare against HF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from jaxserve.multimodal.processing import pil_image_processor_class
from tests.helpers import make_tiny_tokenizer

# A processor chat template that renders an image part where the text has it (as HF VLM
# templates do), ChatML otherwise.
IMAGE_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}IMAGE_MARK{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def draw_image(seed: int, width: int = 80, height: int = 60) -> Image.Image:
    """A gradient with a filled ellipse, a rectangle and rendered text, different per seed."""
    rng = np.random.default_rng(seed)
    a = np.zeros((height, width, 3), np.uint8)
    a[..., 0] = np.linspace(0, 255, width)[None].astype(np.uint8)
    a[..., 1] = np.linspace(255, 0, height)[:, None].astype(np.uint8)
    a[..., 2] = rng.integers(0, 255)
    im = Image.fromarray(a)
    draw = ImageDraw.Draw(im)
    x, y = rng.integers(0, width // 3), rng.integers(0, height // 3)
    draw.ellipse([x, y, x + width // 2, y + height // 2], fill=tuple(rng.integers(0, 255, 3)))
    draw.rectangle([width // 2, height // 2, width - 3, height - 3], outline=(255, 255, 255))
    draw.text((4, height - 14), f"img{seed}", fill=(0, 0, 0))
    return im


def _tokenizer(out: Path, specials: list[str], mark: str):
    from transformers import AutoTokenizer

    make_tiny_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *specials]})
    tok.chat_template = IMAGE_CHATML.replace("IMAGE_MARK", mark)
    tok.save_pretrained(out)
    return tok


def _save(model_cls, config, out: Path) -> None:
    """The model of `config` with random weights (norms near 1), fp32, saved to `out`."""
    config.architectures = [model_cls.__name__]
    model = model_cls(config).float()
    _randomise(model)
    model.save_pretrained(out)


def _randomise(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)


def make_tiny_llava(out: Path) -> Path:
    """LLaVA-1.5's layout: a 3-layer CLIP tower (56 px, patch 14: 16 tokens an image), a
    2-layer Llama; `<image>` once per image in the prompt."""
    import transformers

    tok = _tokenizer(out, ["<image>"], "<image>")
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=56, patch_size=14, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
    )  # fmt: skip
    _save(transformers.LlavaForConditionalGeneration, config, out)
    clip = pil_image_processor_class("CLIPImageProcessor")
    processor = clip(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor.save_pretrained(out)
    return out


def llava_hf_processor(model_dir: Path):
    """HF's LlavaProcessor over the tiny model's files: the reference expansion."""
    import transformers

    return transformers.LlavaProcessor(
        image_processor=pil_image_processor_class("CLIPImageProcessor").from_pretrained(model_dir),
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
        patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip


def make_tiny_qwen2_5_vl(out: Path) -> Path:
    """Qwen2.5-VL's layout: a 4-block windowed ViT (patch 14, merge 2, window 56, block 3
    full attention), a 2-layer Qwen2 with M-RoPE; `<|vision_start|><|image_pad|><|vision_end|>`
    per image, images at their own resolution (min/max pixels small)."""
    import transformers

    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    tok = _tokenizer(out, specials, "".join(specials))
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": len(tok),
            "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
            "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [3],
        },
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    _save(transformers.Qwen2_5_VLForConditionalGeneration, config, out)
    qwen_processor(out, save=True)
    return out


def make_tiny_qwen3_5(out: Path, moe: bool = False) -> Path:
    """Qwen3.5's layout: a 2-block vision tower (patch 16, merge 2, learned positions on a 4x4
    table), a 3-layer hybrid language model (linear, full, linear attention) with interleaved
    M-RoPE over a whole 16-wide head ([3, 3, 2]); Qwen2.5-VL's image tokens. moe: the MoE
    build (Qwen3_5MoeForConditionalGeneration)."""
    import transformers

    from tests.models.test_qwen3_5 import MOE, SHAPE

    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    tok = _tokenizer(out, specials, "".join(specials))
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    }
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{kind}Config")(
        text_config={**SHAPE, **(MOE if moe else {}), "hidden_size": 64, "intermediate_size": 128,
                     "vocab_size": len(tok), "max_position_embeddings": 1024,
                     "rope_parameters": rope},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                       "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 16},
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    _save(getattr(transformers, f"{kind}ForConditionalGeneration"), config, out)
    qwen3_5_processor(out, save=True)
    return out


def make_tiny_qwen3_vl(out: Path, moe: bool = False) -> Path:
    """Qwen3-VL's layout: Qwen3.5's tower (3 blocks) with DeepStack after blocks 0 and 1, a
    2-layer Qwen3 language model with interleaved M-RoPE ([3, 3, 2] over 16-wide heads);
    moe: Qwen3-VL-MoE's, 8 experts (top 2) in each layer."""
    import transformers

    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    tok = _tokenizer(out, specials, "".join(specials))
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    }
    kind = "Qwen3VLMoe" if moe else "Qwen3VL"
    # (48 gate + up columns, not the hidden 64: the two layouts of fused experts differ)
    experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    config = getattr(transformers, f"{kind}Config")(
        text_config={**(experts if moe else {}), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "vocab_size": len(tok), "max_position_embeddings": 1024,
                     "rope_parameters": rope},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                       "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": [0, 1]},
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    _save(getattr(transformers, f"{kind}ForConditionalGeneration"), config, out)
    qwen3_5_processor(out, save=True)
    return out


def qwen3_5_processor(model_dir: Path, save: bool = False):
    cls = pil_image_processor_class("Qwen2VLImageProcessor")
    if save:
        cls(patch_size=16, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16).save_pretrained(
            model_dir
        )
    return cls.from_pretrained(model_dir)


GEMMA3_IMAGE = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def make_tiny_gemma3(out: Path) -> Path:
    """Gemma 3's layout: a 2-layer SigLIP tower (64 px, patch 8, pooled to 16 tokens), a
    2-layer Gemma 3 language model (a sliding layer of window 8, shorter than an image, and a
    full one); `<start_of_image>` once per image in the prompt."""
    import transformers

    tok = _tokenizer(out, GEMMA3_IMAGE, "<start_of_image>")
    ids = [tok.convert_tokens_to_ids(s) for s in GEMMA3_IMAGE]
    config = transformers.Gemma3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                       "num_hidden_layers": 2, "image_size": 64, "patch_size": 8},
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "vocab_size": len(tok), "sliding_window": 8,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "max_position_embeddings": 512},
        mm_tokens_per_image=16, boi_token_index=ids[0], eoi_token_index=ids[1],
        image_token_index=ids[2],
    )  # fmt: skip
    _save(transformers.Gemma3ForConditionalGeneration, config, out)
    gemma3_processor(out, save=True)
    return out


def gemma3_processor(model_dir: Path, save: bool = False):
    cls = pil_image_processor_class("Gemma3ImageProcessor")
    if save:
        cls(size={"height": 64, "width": 64}).save_pretrained(model_dir)
    return cls.from_pretrained(model_dir)


def qwen_processor(model_dir: Path, save: bool = False):
    cls = pil_image_processor_class("Qwen2VLImageProcessor")
    if save:
        cls(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(model_dir)
    return cls.from_pretrained(model_dir)


GEMMA4_IMAGE = ["<|image>", "<image|>", "<|image|>"]


def make_tiny_gemma4(out: Path) -> Path:
    """Gemma 4's layout: a 2-layer tower (patches of 4 px pooled 2 x 2, at most 70 tokens an
    image at its own aspect ratio; clipped linears and standardised features with bounds
    that bite), a 4-layer Gemma 4 language model (sliding window 8, shorter than an image,
    wider full layers whose V is K, the last two sharing the first two's KV, per-layer
    embeddings); `<|image|>` once per image in the prompt, wrapped in `<|image>` ..
    `<image|>`."""
    import transformers

    tok = _tokenizer(out, GEMMA4_IMAGE, "<|image|>")
    ids = [tok.convert_tokens_to_ids(s) for s in GEMMA4_IMAGE]
    config = transformers.Gemma4Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
                       "patch_size": 4, "pooling_kernel_size": 2, "position_embedding_size": 64,
                       "standardize": True, "use_clipped_linears": True},
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "global_head_dim": 32, "num_global_key_value_heads": 1,
                     "attention_k_eq_v": True, "vocab_size": len(tok),
                     "vocab_size_per_layer_input": len(tok), "hidden_size_per_layer_input": 8,
                     "sliding_window": 8, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "max_position_embeddings": 512, "use_bidirectional_attention": "vision"},
        audio_config=None, boi_token_id=ids[0], eoi_token_id=ids[1], image_token_id=ids[2],
    )  # fmt: skip
    config.architectures = ["Gemma4ForConditionalGeneration"]
    model = transformers.Gemma4ForConditionalGeneration(config).float()
    _randomise(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            bound = {"input_min": -1.5, "input_max": 1.5, "output_min": -1.0, "output_max": 1.0}
            if name.rsplit(".", 1)[-1] in bound:
                b.fill_(bound[name.rsplit(".", 1)[-1]])
            elif name.endswith(("std_scale", "layer_scalar")):
                b.uniform_(0.5, 1.5)
            elif name.endswith("std_bias"):
                b.uniform_(-0.2, 0.2)
    model.save_pretrained(out)
    gemma4_processor(out, save=True)
    return out


def gemma4_processor(model_dir: Path, save: bool = False):
    cls = pil_image_processor_class("Gemma4ImageProcessor")
    if save:
        cls(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70).save_pretrained(model_dir)
    return cls.from_pretrained(model_dir)
