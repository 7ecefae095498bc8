"""A model's HF config and generation config, read without loading its weights: the engine
config (`read_model_config`) and the frontend need only these."""

from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.transformers_utils.gguf_file import gguf_reader
from jaxserve.transformers_utils.model_path import resolve_model_path

# GGUF `general.architecture` -> the HF architecture it is read as
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


@functools.lru_cache(maxsize=8)
def read_model_config(
    model: str | Path | None, dtype: str = "auto", quantization: str | None = None
) -> ModelConfig:
    """The model's architecture without loading its weights (the frontend needs only this)."""
    path = resolve_model_path(model)
    hf_config = gguf_hf_config(path) if path.is_file() else read_hf_config(path)
    return ModelConfig.from_hf(hf_config, dtype, quantization)


def read_hf_config(model_dir: Path):
    """The transformers config of a HF (or jaxserve checkpoint) directory."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read {model_dir / 'config.json'}: {e}") from e


class GGUFConfig(types.SimpleNamespace):
    """A GGUF's architecture under transformers' `LlamaConfig` attribute names and defaults
    (what `ModelConfig.from_hf` reads), built without importing transformers: where torch is
    installed that import alone took ~2-3 s of every start-up. `to_transformers()` gives the
    `LlamaConfig` where one is needed (saving a checkpoint, the HF peer)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(
            **{"model_type": "llama", "hidden_act": "silu", "attention_bias": False,
               "mlp_bias": False, **fields}
        )  # fmt: skip

    def to_transformers(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(**{k: v for k, v in vars(self).items() if k != "model_type"})


def gguf_hf_config(path: Path) -> GGUFConfig:
    """The model config in the metadata of the GGUF file at `path` (a `GGUFConfig`).

    Built from the handful of fields a llama model needs rather than through
    `AutoConfig.from_pretrained(gguf_file=...)`, which parses the whole tokenizer vocabulary
    into Python objects (+330 MiB of host memory for SmolLM2) just to read them.
    """
    reader = gguf_reader(path)

    def field(key: str):
        found = reader.get_field(key)
        return None if found is None else found.contents()

    def f(key, default=None):
        value = field(f"llama.{key}")
        return default if value is None else value

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:  # as models/weight_sources.py::GGUFSource says it
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported (llama only)")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path} stores llama3 rope scaling as a rope_freqs tensor; "
            "load the HF checkpoint instead"
        )
    rope_scaling = None
    if f("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(f("rope.scaling.factor"))}
    num_heads = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    vocab = f("vocab_size") or len(field("tokenizer.ggml.tokens"))
    return GGUFConfig(
        architectures=[_GGUF_ARCHITECTURES[arch]],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")),
        num_hidden_layers=int(f("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(f("attention.head_count_kv", num_heads)),
        head_dim=int(f("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(f("context_length")),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        # No output.weight (HF's lm_head.weight) in the file: the lm_head is the embedding
        # (SmolLM2, Llama 3.2 1B).
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )


def read_generation_config(model: str | Path | None):
    """The model's transformers GenerationConfig, or None."""
    path = resolve_model_path(model)
    from transformers import GenerationConfig

    if path.is_dir() and (path / "generation_config.json").exists():
        return GenerationConfig.from_pretrained(path)
    return None
