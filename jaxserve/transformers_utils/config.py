"""A model's HF config and generation config, read without loading its weights: the engine
config (`read_model_config`) and the frontend need only these."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import types
from pathlib import Path
from typing import Any

from jaxserve import envs
from jaxserve.config import ModelConfig
from jaxserve.config.json_flag import json_object
from jaxserve.transformers_utils.gguf_file import gguf_reader
from jaxserve.transformers_utils.model_path import resolve_model_path

# GGUF `general.architecture` -> the HF architecture it is read as
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

logger = logging.getLogger(__name__)


def read_model_config(
    model: str | Path | None,
    dtype: str = "auto",
    quantization: str | None = None,
    hf_overrides: dict | None = None,
    load_format: str = "auto",
) -> ModelConfig:
    """The model's architecture without loading its weights (the frontend needs only this);
    hf_overrides: fields set over the HF config's (vLLM's --hf-overrides); load_format "dummy":
    random weights (with a packed -q format, packed: ModelConfig.from_hf)."""
    overrides = json.dumps(hf_overrides or {})
    return _read_model_config(model, dtype, quantization, overrides, load_format)


@functools.lru_cache(maxsize=8)
def _read_model_config(
    model, dtype: str, quantization: str | None, overrides: str, load_format: str
):
    path = resolve_model_path(model)
    hf_config = read_any_hf_config(path, json.loads(overrides))
    return ModelConfig.from_hf(hf_config, dtype, quantization, load_format)


def read_any_hf_config(path: Path, hf_overrides: dict | None = None) -> Any:
    """The HF config of a directory or a GGUF file, with hf_overrides set over it (a
    multimodal model served as its text model: `text_model_config`)."""
    if not path.is_file():
        return text_model_config(read_hf_config(path, hf_overrides))
    hf_config = copy.copy(gguf_hf_config(path))
    for name, value in (hf_overrides or {}).items():
        setattr(hf_config, name, value)
    return hf_config


# Multimodal architectures served as their text model (the vision tower is not read yet).
TEXT_MODELS = ("Llama4ForConditionalGeneration",)
# Vision-language models: the language model's fields as the config, the whole HF config kept
# as `multimodal_config` (a dict: vision_config, the projector's fields, the image tokens).
MULTIMODAL_MODELS = (
    "LlavaForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)


def text_model_config(hf_config: Any) -> Any:
    """A TEXT_MODELS or MULTIMODAL_MODELS config -> its `text_config` as an HFConfig, with the
    multimodal architecture (the model class reads the text model's weights under its own
    prefix), the top level's tie_word_embeddings and quantization_config (and, for
    MULTIMODAL_MODELS, the whole config as `multimodal_config`); any other config as it is."""
    archs = getattr(hf_config, "architectures", None) or []
    text = getattr(hf_config, "text_config", None)
    if not archs or archs[0] not in TEXT_MODELS + MULTIMODAL_MODELS or not isinstance(text, dict):
        return hf_config
    fields = {**text, "architectures": list(archs)}
    tie = getattr(hf_config, "tie_word_embeddings", None)
    if tie is not None:  # the whole model's, as transformers ties (Qwen3-VL-MoE's text config
        fields["tie_word_embeddings"] = tie  # defaults to True, its model to False)
    if getattr(hf_config, "quantization_config", None):
        fields["quantization_config"] = hf_config.quantization_config
    if archs[0] in MULTIMODAL_MODELS:
        fields["multimodal_config"] = {k: v for k, v in vars(hf_config).items()}
    return HFConfig(**fields)


def check_hf_overrides(overrides: dict | str | None) -> dict:
    """--hf-overrides parsed (a JSON object of HF config fields)."""
    return json_object(overrides, "hf_overrides")


def read_hf_config(model_dir: Path, hf_overrides: dict | None = None) -> HFConfig:
    """The config transformers resolves from a HF (or jaxserve checkpoint) directory, class
    defaults filled in, hf_overrides set over config.json's fields (before transformers
    resolves aliases: `n_routed_experts` also sets `num_local_experts`), as a plain
    `HFConfig`. Kept as JSON under JAXSERVE_CONFIG_CACHE, keyed by config.json's bytes, the
    overrides and transformers' version: a later start reads that instead of importing
    transformers (2-4 s of every engine start where torch is installed)."""
    config_json = model_dir / "config.json"
    overrides = hf_overrides or {}
    key = None
    cache = envs.JAXSERVE_CONFIG_CACHE
    if cache and config_json.is_file():
        digest = hashlib.sha256(config_json.read_bytes())
        digest.update(f"{_CACHE_FORMAT} {importlib.metadata.version('transformers')}".encode())
        if overrides:
            digest.update(json.dumps(overrides, sort_keys=True).encode())
        key = Path(cache).expanduser() / f"{digest.hexdigest()}.json"
        with contextlib.suppress(OSError, ValueError):
            return HFConfig(**json.loads(key.read_text()))
    from transformers import AutoConfig

    try:
        resolved = AutoConfig.from_pretrained(model_dir, **overrides)
    except (ValueError, OSError, TypeError) as e:
        raise ValueError(f"cannot read {config_json}: {e}") from e
    fields = resolved.to_dict()
    for alias, name in resolved.attribute_map.items():  # e.g. Qwen3-MoE's num_experts
        if name in fields:
            fields.setdefault(alias, fields[name])
    fields = json.loads(json.dumps(fields, default=str))  # what a cache read gives
    if key is not None:
        with contextlib.suppress(OSError):
            key.parent.mkdir(parents=True, exist_ok=True)
            tmp = key.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(fields))
            os.replace(tmp, key)
    return HFConfig(**fields)


_CACHE_FORMAT = 1  # bump when what is stored changes


class HFConfig(types.SimpleNamespace):
    """A transformers model config as plain attributes (`to_dict()`'s fields and the class's
    attribute aliases): what `ModelConfig.from_hf` and the models read, without transformers.
    `to_transformers()` gives the transformers config where one is needed (saving a
    checkpoint)."""

    def to_transformers(self) -> Any:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        fields = dict(vars(self))
        config_cls = CONFIG_MAPPING[fields.pop("model_type")]
        for alias in config_cls.attribute_map:
            fields.pop(alias, None)
        return config_cls.from_dict(fields)


class GGUFConfig(types.SimpleNamespace):
    """A GGUF's architecture under transformers' `LlamaConfig` attribute names and defaults
    (what `ModelConfig.from_hf` reads), built without importing transformers: where torch is
    installed that import alone took ~2-3 s of every start-up. `to_transformers()` gives the
    `LlamaConfig` where one is needed (saving a checkpoint, the HF peer)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(
            **{
                "model_type": "llama",
                "hidden_act": "silu",
                "attention_bias": False,
                "mlp_bias": False,
                **fields,
            }
        )

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
    """The transformers GenerationConfig of a model (or of a directory holding only a
    generation_config.json), or None when it has none."""
    path = Path(model) if model is not None and Path(model).is_dir() else resolve_model_path(model)
    if not (path.is_dir() and (path / "generation_config.json").exists()):
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(path)


# generation_config.json's fields vLLM reads as default sampling parameters -> SamplingParams'
# names (max_new_tokens: a cap on every request's output tokens, not only a default)
GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def check_generation_config(source: str, override: dict | str | None) -> dict[str, Any]:
    """--generation-config (auto | vllm | a directory with a generation_config.json) checked,
    and --override-generation-config parsed (JSON of GENERATION_FIELDS' names). ValueError
    names the bad value."""
    if source not in ("auto", "vllm"):
        path = Path(source).expanduser()
        if not (path / "generation_config.json").is_file():
            raise ValueError(
                f"generation_config {source!r} is neither 'auto', 'vllm' nor a directory with "
                "a generation_config.json"
            )
    override = json_object(override, "override_generation_config")
    unknown = sorted(set(override) - set(GENERATION_FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown fields {unknown}; it sets "
            f"{', '.join(GENERATION_FIELDS)}"
        )
    for name, value in override.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"override_generation_config: {name} must be a number, got {value!r}")
    return override


def generation_defaults(
    model_path: str, source: str = "auto", override: dict | None = None
) -> dict:
    """vLLM's default sampling parameters, in SamplingParams' names: the GENERATION_FIELDS a
    generation_config.json sets (transformers' to_diff_dict, as vLLM reads it; the model's own
    with "auto", the directory's, none with "vllm"), then the override's. They fill what a
    request leaves unset; max_tokens (max_new_tokens) also caps every request's output."""
    fields: dict[str, Any] = {}
    if source != "vllm":
        config = read_generation_config(model_path if source == "auto" else source)
        if config is not None:
            fields = config.to_diff_dict()
    fields.update(override or {})
    return {
        ours: fields[theirs]
        for theirs, ours in GENERATION_FIELDS.items()
        if fields.get(theirs) is not None
    }


def log_generation_defaults(config: Any) -> dict:
    """generation_defaults of an EngineConfig, logged when there are any (as vLLM warns)."""
    defaults = generation_defaults(
        config.model_path, config.generation_config, config.override_generation_config
    )
    if defaults:
        logger.info(
            "default sampling parameters from --generation-config %s%s: %s (a request's own "
            "values win; max_tokens caps every request); --generation-config vllm for none",
            config.generation_config,
            " and --override-generation-config" if config.override_generation_config else "",
            defaults,
        )
    return defaults
