"""New weights for a loaded model without a restart: HF-named tensors (a trainer's
`state_dict()`, a checkpoint directory) turned into the engine's parameters through the same
mapping that loads them (`LlamaForCausalLM.hf_weight` per family: fused qkv / gate_up,
[out, in] -> [in, out], quantized as they load), one parameter at a time.

The engine's own layout needs none of this: a parameter's engine name is its path in the
model's nnx state joined by dots (`layers.3.self_attn.qkv_proj.kernel`, `embed_tokens.embedding`),
and worker/device_state.py adopts such arrays as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.loader import CHECKPOINT_MARKER, aliased, read_params
from jaxserve.models.registry import get_model_class
from jaxserve.models.weight_sources import GGUFSource, SafetensorsSource

# HF state_dict entries that are no parameter of ours: rotary tables HF keeps as buffers.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DictSource:
    """HF-named host arrays as a weight source (what SafetensorsSource offers the loader)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self._tensors = {name: np.asarray(t) for name, t in tensors.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> np.ndarray:
        return self._tensors[name]


def checkpoint_source(path: str | Path) -> Any:
    """The weight source of a HF directory (`*.safetensors`) or a .gguf file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_file():
        return GGUFSource(path)
    if (path / CHECKPOINT_MARKER).exists():
        raise ValueError(
            f"{path} is a jaxserve (orbax) checkpoint: reloading weights reads a HF directory "
            "(safetensors) or a .gguf file"
        )
    return SafetensorsSource(path)


def covered_paths(
    source: Any, config: ModelConfig, kv_replicas: int, paths: list[tuple]
) -> tuple[set[tuple], set[str]]:
    """The parameters (of `paths`) that `source`'s HF tensors build, and the HF names they
    read. A parameter built from several tensors needs all of them (q, k and v for the fused
    qkv_proj): some but not all is a ValueError naming the missing ones."""
    model_cls = get_model_class(config.architecture)
    covered, used = set(), set()
    for path in paths:
        if path[-1] in ("scale", "offset", "perm"):
            continue  # built with its quantized kernel
        names = aliased(source, model_cls.hf_weight(config, path, kv_replicas), model_cls).names
        present = [n for n in names if n in source]
        if present and len(present) < len(names):
            missing = sorted(set(names) - set(present))
            raise ValueError(
                f"{'.'.join(map(str, path))} is built from {', '.join(names)}: "
                f"{', '.join(missing)} missing from the update"
            )
        if present:
            covered.add(path)
            used.update(names)
            used.update(n.removesuffix("weight") + "weight_scale" for n in names)
    covered |= {
        p for p in paths if p[-1] in ("scale", "offset", "perm") and (*p[:-1], "kernel") in covered
    }
    return covered, used


def read_hf_params(
    source: Any,
    config: ModelConfig,
    kv_replicas: int,
    targets: dict[tuple, Any],
    place: Callable[[tuple, np.ndarray], None],
    *,
    partial: bool,
) -> int:
    """Build the parameters of `targets` (path -> ShapeDtypeStruct) that `source`'s HF tensors
    cover, handing each to `place(path, host array)`; returns how many were placed.

    partial: a trainer's tensors, maybe only some: a name that builds none of our parameters
    is a ValueError naming it."""
    covered, used = covered_paths(source, config, kv_replicas, list(targets))
    if partial and not isinstance(source, GGUFSource):
        tied = "lm_head.weight" if config.tie_word_embeddings else None
        unknown = sorted(
            n
            for n in source.names()
            if n not in used and n != tied and not n.endswith(_IGNORED_SUFFIXES)
        )
        if unknown:
            raise ValueError(
                f"unknown weight names (no parameter of {config.architecture} is built from "
                f"them): {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
            )
    if not covered:
        raise ValueError("the update holds no weight of this model")
    model_cls = get_model_class(config.architecture)
    read_params(
        source,
        model_cls,
        config,
        kv_replicas,
        {p: targets[p] for p in targets if p in covered},
        place,
        "update",
    )
    return len(covered)
