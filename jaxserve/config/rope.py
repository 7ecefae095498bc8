"""Rotary embedding parameters (`RopeConfig`), read from the HF config's `rope_parameters`
(or `rope_theta` and `rope_scaling`); layers/rotary.py computes the frequencies."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_theta` + `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn | proportional
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    # yarn: cos / sin scale (None: from factor, mscale, mscale_all_dim), the ramp's bounds
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # M-RoPE: frequencies per position axis (t, h, w), in sections (Qwen2.5-VL) or interleaved
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # proportional (Gemma 4's full layers): the first `proportion` of each head's frequency
    # pairs turn, at theta ** (-2i / head_dim); the others stay (frequency 0)
    proportion: float = 1.0

    SUPPORTED = ("default", "linear", "llama3", "yarn", "proportional")

    @classmethod
    def from_hf(cls, hf_config: Any, layer_type: str | None = None) -> RopeConfig:
        """layer_type: the entry of per-layer-type rope_parameters (Gemma 3's
        full_attention / sliding_attention), when the config has them."""
        # transformers >= 5 folds rope_theta into `rope_parameters`; 4.x has both separately.
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        if params and all(isinstance(v, dict) for v in params.values()):
            params = dict(params.get(layer_type or "full_attention", {}))
        params = {**(getattr(hf_config, "rope_scaling", None) or {}), **params}
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        rope_type = "default" if rope_type == "mrope" else rope_type  # (Qwen2-VL's name)
        if rope_type not in cls.SUPPORTED:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(cls.SUPPORTED)}"
            )
        # As transformers standardises it: the config's own field first (Phi-3 keeps it
        # there), then the rope parameters, then max_position_embeddings.
        original = getattr(hf_config, "original_max_position_embeddings", None) or params.get(
            "original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", 8192)
        )
        optional = lambda key: None if params.get(key) is None else float(params[key])  # noqa: E731
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor") or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
            attention_factor=optional("attention_factor"),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=optional("mscale"),
            mscale_all_dim=optional("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            mrope_section=tuple(params["mrope_section"]) if params.get("mrope_section") else None,
            mrope_interleaved=bool(params.get("mrope_interleaved", False)),
            proportion=float(params.get("partial_rotary_factor", 1.0))
            if rope_type == "proportional"
            else 1.0,
        )
