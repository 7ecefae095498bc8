"""A model's tokenizer: transformers' for a HF directory, one built from the file's metadata
for a GGUF (gguf_tokenizer.py, no torch). `--tokenizer-mode deepseek_v32` (vLLM's) gives it
DeepSeek-V3.2's prompt encoding in place of a chat template (`chat_encoding`)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from jaxserve.transformers_utils import deepseek_v32_chat
from jaxserve.transformers_utils.gguf_tokenizer import read_gguf_tokenizer
from jaxserve.transformers_utils.model_path import resolve_model_path

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# --tokenizer-mode values: "auto" and "hf" the tokenizer's chat template, the others a prompt
# encoding written as code, (messages, tools, chat_template_kwargs, continue_final) -> text
CHAT_ENCODINGS = {"deepseek_v32": deepseek_v32_chat.render}
TOKENIZER_MODES = ("auto", "hf", *CHAT_ENCODINGS)


def check_tokenizer_mode(mode: str) -> None:
    if mode not in TOKENIZER_MODES:
        raise ValueError(
            f"tokenizer_mode {mode!r} is not supported: jaxserve has {', '.join(TOKENIZER_MODES)}"
        )


def read_tokenizer(model: str | Path | None, mode: str = "auto"):
    """The model's transformers tokenizer, or None when it ships none (token-id prompts only).
    A directory is read as it is: --tokenizer may name one of tokenizer files alone."""
    check_tokenizer_mode(mode)
    path = Path(model) if model is not None and Path(model).is_dir() else resolve_model_path(model)
    if path.is_dir() and not any((path / f).exists() for f in _TOKENIZER_FILES):
        logger.info("%s has no tokenizer files; token-id prompts only", path)
        return None
    try:
        if path.is_file():  # not transformers' GGUF reader: it needs torch
            tokenizer = read_gguf_tokenizer(path)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no tokenizer loaded from %s (%s); token-id prompts only", path, e)
        return None
    return with_chat_encoding(tokenizer, mode) if mode in CHAT_ENCODINGS else tokenizer


def with_chat_encoding(tokenizer: Any, mode: str) -> Any:
    """A copy of `tokenizer` whose apply_chat_template (LLM.chat's) and `chat_encoding` (the
    server's, chat_utils.render_chat) are the mode's encoding (as vLLM wraps it)."""
    encode = CHAT_ENCODINGS[mode]
    base = type(tokenizer)

    class Encoded(base):  # type: ignore[misc, valid-type]
        chat_encoding = staticmethod(encode)

        def apply_chat_template(self, conversation, tools=None, **kwargs):
            text = encode(
                list(conversation),
                tools,
                kwargs.get("chat_template_kwargs") or kwargs,
                kwargs.get("continue_final_message", False),
            )
            if kwargs.get("tokenize", True):
                return self.encode(text, add_special_tokens=False)
            return text

        def __reduce__(self):
            return with_chat_encoding, (tokenizer, mode)

    Encoded.__name__ = f"{base.__name__}[{mode}]"
    encoded = copy.copy(tokenizer)
    encoded.__class__ = Encoded
    return encoded
