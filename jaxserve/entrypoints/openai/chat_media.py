"""Images in chat messages, as vLLM takes them (/v1/chat/completions and LLM.chat).

- `extract_images`: each `{"type": "image_url", "image_url": {"url": ...}}` part (and, for
  LLM.chat, `{"type": "image_pil", "image_pil": PIL.Image}`) becomes `{"type": "image"}`,
  what HF vision-language chat templates render as the model's image marker; the images'
  sources come out in order.
- `check_image_count`: vLLM's "At most N image(s) may be provided in one prompt." before
  anything is fetched (N is 0 for a text-only model).
- `image_placeholder`: the marker text for a template that takes content as one string.
- `default_chat_template`: a model whose tokenizer has no chat template often ships its
  processor's, as chat_template.jinja or chat_template.json beside the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxserve import envs
from jaxserve.config import MultiModalConfig
from jaxserve.multimodal.media import DEFAULT_MAX_IMAGE_BYTES, load_image_urls

# A vision-language model's image marker (the text its chat template renders for an image
# part), by the HF config's model_type; the engine expands each into the image's tokens.
IMAGE_PLACEHOLDERS = {
    "llava": "<image>",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
}
_PART_FORMS = '{"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": ...}}'


def extract_images(messages: list[Any], *, allow_pil: bool = False) -> tuple[list[Any], list[Any]]:
    """The messages with every image part as {"type": "image"} (messages without one are
    kept as they are), and the images' sources in order: URL strings, or PIL images when
    allow_pil (LLM.chat's image_pil parts). ValueError naming a malformed image part or a
    part of a kind jaxserve does not take (audio, video, embeddings)."""
    out, sources = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts, before = [], len(sources)
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None and isinstance(part, dict) and "image_url" in part:
                kind = "image_url"  # vLLM takes an image part without its type too
            where = f"messages[{i}].content[{j}]"
            if kind == "image_url":
                sources.append(_image_url(where, part.get("image_url")))
            elif kind == "image_pil" and allow_pil:
                sources.append(_image_pil(where, part.get("image_pil")))
            elif kind in ("text", None) or not isinstance(kind, str):
                parts.append(part)  # text, or malformed: template_messages names it
                continue
            else:
                raise ValueError(
                    f"{where}: content parts of type {kind!r} are not supported; use {_PART_FORMS}"
                )
            parts.append({"type": "image"})
        out.append({**message, "content": parts} if len(sources) > before else message)
    return out, sources


def _image_url(where: str, value: Any) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(
            f'{where}.image_url must be {{"url": "<http(s), data: or file:// URL>"}}, '
            f"got {value!r:.200}"
        )
    return url


def _image_pil(where: str, value: Any) -> Any:
    from PIL import Image

    if not isinstance(value, Image.Image):
        raise ValueError(f"{where}.image_pil must be a PIL.Image.Image, got {type(value).__name__}")
    return value


def multimodal_config(config: Any) -> MultiModalConfig:
    """The engine config's image limits (the defaults where it has none)."""
    return getattr(config, "multimodal", None) or MultiModalConfig()


def model_takes_images(model_config: Any) -> bool:
    """Whether the model is one the engine processes images for: its HF config kept whole
    as `multimodal_config` (transformers_utils/config.py), as the InputProcessor reads it."""
    hf_config = getattr(model_config, "hf_config", None)
    return getattr(hf_config, "multimodal_config", None) is not None


def image_placeholder(model_config: Any) -> str | None:
    """The model's image marker text (IMAGE_PLACEHOLDERS), None when unknown."""
    hf_config = getattr(model_config, "hf_config", None)
    mm = getattr(hf_config, "multimodal_config", None) or {}
    return IMAGE_PLACEHOLDERS.get(mm.get("model_type") if isinstance(mm, dict) else None)


def check_image_count(count: int, config: Any) -> None:
    """vLLM's 400 for more images than --limit-mm-per-prompt allows (0 for a text-only
    model), before any is fetched."""
    takes_images = model_takes_images(config.model)
    limit = multimodal_config(config).limit("image") if takes_images else 0
    if count <= limit:
        return
    message = f"At most {limit} image(s) may be provided in one prompt."
    if takes_images:
        message += f" Set `--limit-mm-per-prompt` to increase this limit (got {count})."
    else:
        name = getattr(config.model, "architecture", None) or "The model"
        message += f" {name} is a text-only model: it takes no images (multimodal inputs)."
    raise ValueError(message)


def load_images(
    sources: list[Any], config: Any, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
) -> list[Any]:
    """extract_images' sources as images, synchronously (LLM.chat): PIL images as they are,
    URLs fetched concurrently with the server's limits (each within
    $JAXSERVE_IMAGE_FETCH_TIMEOUT s and max_bytes; file:// under allowed_local_media_path;
    http(s) to allowed_media_domains' hosts and public addresses)."""
    urls = [s for s in sources if isinstance(s, str)]
    mm = multimodal_config(config)
    limits = {
        "max_bytes": max_bytes,
        "timeout": envs.JAXSERVE_IMAGE_FETCH_TIMEOUT,
        "allowed_local_media_path": mm.allowed_local_media_path,
        "allowed_media_domains": mm.allowed_media_domains,
    }
    fetched = iter(load_image_urls(urls, **limits) if urls else ())
    return [next(fetched) if isinstance(s, str) else s for s in sources]


def model_chat_template(*dirs: str | Path | None) -> str | None:
    """The chat template a model directory ships beside its tokenizer files:
    chat_template.jinja, else a processor's chat_template.json ({"chat_template": ...});
    the first of `dirs` that has one."""
    for d in dirs:
        if d is None or not Path(d).is_dir():
            continue
        jinja = Path(d) / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        processor = Path(d) / "chat_template.json"
        if processor.is_file():
            try:
                template = json.loads(processor.read_text()).get("chat_template")
            except (ValueError, AttributeError):
                template = None
            if isinstance(template, str):
                return template
    return None


def default_chat_template(tokenizer: Any, config: Any) -> str | None:
    """The template to use when none is given and the tokenizer has none itself: the
    tokenizer's or the model's directory's (model_chat_template); None otherwise."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is not None:
        return None
    dirs = (getattr(config, "tokenizer_path", None), getattr(config, "model_path", None))
    return model_chat_template(*dirs)
