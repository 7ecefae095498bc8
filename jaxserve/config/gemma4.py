"""Gemma 4's text model (Gemma4ForCausalLM, and the language model of
Gemma4ForConditionalGeneration), read from its HF config (Gemma4TextConfig): what differs from
the Gemma 3 fields `ModelConfig.from_hf` reads.

- Full-attention layers have their own head_dim (`global_head_dim`, 512) and, with
  `attention_k_eq_v`, their own KV heads (`num_global_key_value_heads`) whose V is K's
  projection (before K's norm and rotary); transformers keeps both in `per_layer_config`.
  Scores are not scaled (the q / k norms do it); V has a weightless RMSNorm.
- Each kind has its rotary: the sliding layers' default one, the full layers' proportional
  one (the first quarter of the frequency pairs turn).
- The last `num_kv_shared_layers` layers compute no K/V: each reads the cache of the last
  earlier layer of its kind ("KV sharing"), and with `use_double_wide_mlp` has an MLP twice
  as wide.
- Per-layer embeddings (`hidden_size_per_layer_input` > 0): a second embedding table gives
  every token a vector per layer, mixed with a projection of its embedding, that each layer
  adds through a small gated projection.
- `enable_moe_block`: every layer also has routed experts beside its dense MLP.
- Each layer's output is times a learned scalar.
- With images (`use_bidirectional_attention` "vision"), an image's tokens see each other both
  ways in the sliding layers only (and within the window); the full layers stay causal.

The KV cache holds one row width for every layer (config/kv_groups.py): a narrower layer packs
its slot with others of its kind, or views the row as its own heads repeated to fill it
(models/gemma4.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# the text model, and the multimodal one's language model
GEMMA4 = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")


@dataclasses.dataclass(frozen=True)
class Gemma4Layers:
    """Per decoder layer: widths[l] its (KV heads, head_dim); shares[l] the earlier layer
    whose cache it reads (None: its own). k_eq_v: full layers' V is their K projection;
    ple_dim, ple_vocab: the per-layer embeddings' width and vocabulary (0: none);
    double_wide_mlp: KV-sharing layers' MLPs are twice as wide; moe_block: every layer has
    routed experts beside its MLP."""

    widths: tuple[tuple[int, int], ...]
    shares: tuple[int | None, ...]
    k_eq_v: bool = False
    ple_dim: int = 0
    ple_vocab: int = 0
    double_wide_mlp: bool = False
    moe_block: bool = False
    bidirectional_images: bool = False  # sliding layers: an image's tokens see all of it


def gemma4_fields(hf_config: Any) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 4 text config, over the ones read as for Gemma 3."""
    layers = hf_config.num_hidden_layers
    types = list(hf_config.layer_types)[:layers]
    heads, head_dim = hf_config.num_key_value_heads, hf_config.head_dim
    per_layer = {int(k): v for k, v in (getattr(hf_config, "per_layer_config", None) or {}).items()}
    widths = tuple(
        (
            int(per_layer.get(i, {}).get("num_key_value_heads", heads)),
            int(per_layer.get(i, {}).get("head_dim", head_dim)),
        )
        for i in range(layers)
    )
    shared = int(getattr(hf_config, "num_kv_shared_layers", 0) or 0)
    first_shared = layers - shared
    shares = []
    for i, kind in enumerate(types):
        if i < first_shared:
            shares.append(None)
            continue
        earlier = [j for j in range(first_shared) if types[j] == kind]
        if not earlier:
            raise ValueError(f"layer {i} ({kind}) shares KV, but no earlier layer is {kind}")
        shares.append(earlier[-1])
    for i, (h, d) in enumerate(widths):
        if d % head_dim or (types[i] != "full_attention" and (h, d) != (heads, head_dim)):
            raise ValueError(
                f"layer {i}: head_dim {d} is not a multiple of the sliding layers' {head_dim}"
            )
    bidirectional = getattr(hf_config, "use_bidirectional_attention", None)
    if bidirectional == "all":
        raise ValueError("use_bidirectional_attention='all' (an encoder) is not supported")
    moe = bool(getattr(hf_config, "enable_moe_block", False))
    ple_dim = int(getattr(hf_config, "hidden_size_per_layer_input", 0) or 0)
    fields: dict[str, Any] = dict(
        layer_types=tuple(types),
        qk_norm=True,
        query_pre_attn_scalar=1.0,  # scores unscaled
        gemma4=Gemma4Layers(
            widths=widths,
            shares=tuple(shares),
            k_eq_v=bool(getattr(hf_config, "attention_k_eq_v", False)),
            ple_dim=ple_dim,
            ple_vocab=int(getattr(hf_config, "vocab_size_per_layer_input", 0) or 0),
            double_wide_mlp=bool(getattr(hf_config, "use_double_wide_mlp", False)),
            moe_block=moe,
            bidirectional_images=bidirectional == "vision",
        ),
    )
    return fields | dict(
        num_experts=int(hf_config.num_experts) if moe else 0,
        num_experts_per_tok=int(hf_config.top_k_experts) if moe else 0,
        moe_intermediate_size=int(hf_config.moe_intermediate_size) if moe else 0,
        norm_topk_prob=True,
        dense_layers=(),
    )
