"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), read from the HF config: the
paged cache holds each token's compressed latent and its decoupled rotary key, one "head" of
kv_lora_rank + qk_rope_head_dim values shared by every query head (models/deepseek.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Architectures whose attention is MLA.
MLA_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
)


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite), else q_a -> norm -> q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary dims in interleaved pairs (HF's rope_interleave)
    sm_scale: float  # (nope + rope) ** -0.5, times YaRN's mscale(mscale_all_dim) ** 2
    # DeepSeek Sparse Attention's indexer (DeepSeek-V3.2; models/deepseek_v32.py): its heads,
    # head dim (0: none; its keys the V cache's values) and the tokens each query keeps
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # per layer: whether it reuses the last full indexer layer's top-k (GLM-5's "shared")
    index_shared: tuple[bool, ...] = ()

    @property
    def latent_dim(self) -> int:
        """Values a token keeps per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_config(hf_config: Any, architecture: str, rope_params: dict) -> MlaConfig | None:
    if architecture not in MLA_ARCHITECTURES:
        return None
    nope, rope = int(hf_config.qk_nope_head_dim), int(hf_config.qk_rope_head_dim)
    scale = (nope + rope) ** -0.5
    if rope_params.get("rope_type", "default") != "default":
        factor, all_dim = float(rope_params.get("factor") or 1.0), rope_params.get("mscale_all_dim")
        if all_dim and factor > 1:
            mscale = 0.1 * float(all_dim) * math.log(factor) + 1.0
            scale *= mscale * mscale
    q_lora = getattr(hf_config, "q_lora_rank", None)
    interleave = getattr(hf_config, "rope_interleave", None)  # (V3.2's config: None, always)
    return MlaConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(hf_config.kv_lora_rank),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(hf_config.v_head_dim),
        rope_interleave=True if interleave is None else bool(interleave),
        sm_scale=scale,
        index_n_heads=int(getattr(hf_config, "index_n_heads", 0) or 0),
        index_head_dim=int(getattr(hf_config, "index_head_dim", 0) or 0),
        index_topk=int(getattr(hf_config, "index_topk", 0) or 0),
        index_shared=_index_shared(getattr(hf_config, "indexer_types", None)),
    )


def _index_shared(types: list[str] | None) -> tuple[bool, ...]:
    """GLM-5's `indexer_types` ("full" | "shared" per layer) as flags; the first must be full."""
    if not types:
        return ()
    if any(t not in ("full", "shared") for t in types) or types[0] != "full":
        raise ValueError(
            f"indexer_types {types!r} is not supported: each 'full' or 'shared', the first 'full'"
        )
    return tuple(t == "shared" for t in types)
