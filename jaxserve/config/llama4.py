"""Llama 4's text model (Llama4ForCausalLM), read from its HF config (Llama4TextConfig): what
differs from the Llama fields `ModelConfig.from_hf` reads.

- Layers with rotary ("chunked_attention" in `layer_types`) attend only within their
  `attention_chunk_size`-token chunk of the sequence, with weightless q/k norms when
  `use_qk_norm`; every `no_rope_layer_interval`-th layer (`no_rope_layers[i] == 0`) has no
  rotary, attends to the whole context and, with `attn_temperature_tuning`, scales its
  queries by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1.
- Mixture-of-experts layers (`moe_layers`, from `interleave_moe_layer_step`) have
  `num_local_experts` experts of width `intermediate_size`, each token's top
  `num_experts_per_tok` by router logit weighted by its sigmoid (applied to the expert's
  input), and a shared expert of the same width; the other layers a dense MLP of
  `intermediate_size_mlp`.
"""

from __future__ import annotations

from typing import Any

from jaxserve.config.moe import MoeRouting

# the text model, and the multimodal one served as its text model
# (transformers_utils/config.py::text_model_config)
LLAMA4 = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")


def llama4_fields(hf_config: Any) -> dict[str, Any]:
    """ModelConfig fields of a Llama 4 text config, over the ones read as for Llama."""
    layers = hf_config.num_hidden_layers
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported for Llama 4 (no checkpoint has it)")
    rope = list(getattr(hf_config, "no_rope_layers", None) or [1] * layers)
    types = list(
        getattr(hf_config, "layer_types", None)
        or ["chunked_attention" if r else "full_attention" for r in rope]
    )
    if len(rope) < layers or len(types) < layers:
        raise ValueError(
            f"no_rope_layers ({len(rope)}) and layer_types ({len(types)}) must have an entry "
            f"for each of the {layers} layers"
        )
    rope, types = rope[:layers], types[:layers]  # the first layers (--hf-overrides)
    for i, (kind, rotary) in enumerate(zip(types, rope, strict=True)):
        if kind not in ("chunked_attention", "full_attention"):
            raise ValueError(f"layer_types[{i}] {kind!r} is not supported for Llama 4")
        if kind == "chunked_attention" and not rotary:
            raise ValueError(f"layer {i}: chunked attention without rotary is not supported")
    chunk = getattr(hf_config, "attention_chunk_size", None)
    moe_layers = set(getattr(hf_config, "moe_layers", None) or range(layers))
    experts_width = int(hf_config.intermediate_size)
    tuning = getattr(hf_config, "attn_temperature_tuning", False)
    return dict(
        intermediate_size=int(getattr(hf_config, "intermediate_size_mlp", experts_width)),
        moe_intermediate_size=experts_width,
        dense_layers=tuple(i for i in range(layers) if i not in moe_layers),
        moe_routing=MoeRouting(
            scoring="sigmoid_topk", scale_inputs=True, shared_intermediate=experts_width
        ),
        qk_norm=False,
        qk_l2_norm=bool(getattr(hf_config, "use_qk_norm", False)),
        layer_types=tuple(types),
        attention_chunk_size=int(chunk) if chunk else None,
        nope_layers=tuple(i for i, r in enumerate(rope) if not r),
        attn_temperature=(
            (float(hf_config.floor_scale), float(hf_config.attn_scale)) if tuning else None
        ),
    )
