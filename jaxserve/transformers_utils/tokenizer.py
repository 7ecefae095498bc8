"""A model's tokenizer: transformers' for a HF directory, one built from the file's metadata
for a GGUF (gguf_tokenizer.py, no torch)."""

from __future__ import annotations

import logging
from pathlib import Path

from jaxserve.transformers_utils.gguf_tokenizer import read_gguf_tokenizer
from jaxserve.transformers_utils.model_path import resolve_model_path

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_tokenizer(model: str | Path | None):
    """The model's transformers tokenizer, or None when it ships none (token-id prompts only).
    A directory is read as it is: --tokenizer may name one of tokenizer files alone."""
    path = Path(model) if model is not None and Path(model).is_dir() else resolve_model_path(model)
    from transformers import AutoTokenizer

    if path.is_dir() and not any((path / f).exists() for f in _TOKENIZER_FILES):
        logger.info("%s has no tokenizer files; token-id prompts only", path)
        return None
    try:
        if path.is_file():  # not transformers' GGUF reader: it needs torch
            return read_gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no tokenizer loaded from %s (%s); token-id prompts only", path, e)
        return None
