"""Multi-token-prediction (MTP) draft heads of DeepSeek-V3 / R1 / V3.2, GLM-4.5 / 4.6 and GLM-5
(vLLM's `DeepSeekMTPModel`, `Glm4MoeMTPModel`; speculative method `mtp`).

These checkpoints ship `num_nextn_predict_layers` MTP layers after their decoder layers, at
index L = num_hidden_layers: `model.layers.{L}.enorm`, `.hnorm` (RMSNorms), `.eh_proj`
[D, 2D] (no bias), `.shared_head.norm` (and `.shared_head.head`, the LM head again: the
target's is used, as vLLM shares it when they are equal), and a decoder block of the target's
kind under `model.layers.{L}.` (DeepSeek: MLA attention and routed experts, V3.2's with its
sparse-attention indexer, as GLM-5's; GLM: its attention and experts), named as the target's
own layers.

One draft step (at position p, from the target's hidden state h_p and the next token x_{p+1}):
    x = block(eh_proj([enorm(embed(x_{p+1})) ; hnorm(h_p)]))
    logits = lm_head(shared_head.norm(x))
transformers' MtpLayer with use_post_norm (and its `mtp_hidden_states_first`: [hnorm ; enorm]).
As vLLM, the one layer drafts all k tokens: each later step feeds back the block's output x
before shared_head.norm (transformers feeds back the normed one).

The head takes the proposer interface of an EAGLE head (models/eagle.py; spec_decode/eagle.py,
spec_decode/mtp.py): `prepare(features)`, `__call__(embeds, h, positions, kv_caches, md)`
-> (output, the next step's feature, kv_caches), `greedy(output, lm_head, ...)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.config.speculative import num_mtp_layers
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.linear import Linear
from jaxserve.layers.norm import RMSNorm
from jaxserve.models.deepseek import DeepseekV3ForCausalLM
from jaxserve.models.deepseek_v32 import DeepseekV32ForCausalLM
from jaxserve.models.eagle import DraftHead
from jaxserve.models.glm4_moe import Glm4MoeForCausalLM
from jaxserve.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from jaxserve.models.llama import HFWeight, KVCaches, LlamaForCausalLM


class MtpHead(DraftHead):
    """Built from the target's config (config.num_layers = L, the target's decoder layers);
    subclasses name the target family whose decoder layer and weight names the block takes."""

    target_cls: type[LlamaForCausalLM] = LlamaForCausalLM

    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        if num_mtp_layers(config.hf_config) < 1:
            raise ValueError(
                f"speculative_config method mtp: {config.architecture} has no "
                "multi-token-prediction layers (num_nextn_predict_layers is 0)"
            )
        self.config = config
        self.kv_replicas = kv_replicas
        self.first_hf_layer = config.num_layers  # its block's index in the checkpoint
        d, dt, eps = config.hidden_size, config.dtype, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps, dtype=dt)
        self.hnorm = RMSNorm(d, eps, dtype=dt)
        self.eh_proj = Linear(2 * d, d, dtype=dt, rngs=rngs)
        block = self.target_cls.layer_cls(
            config, config.num_layers, kv_replicas=kv_replicas, rngs=rngs
        )
        self.layers = nnx.List([block])
        self.shared_head_norm = RMSNorm(d, eps, dtype=dt)
        # transformers' option for checkpoints that order eh_proj's input [hidden ; embedding]
        self.hidden_first = bool(getattr(config.hf_config, "mtp_hidden_states_first", False))

    def __call__(
        self,
        embeds: jax.Array,
        h: jax.Array,
        positions: jax.Array,
        kv_caches: KVCaches,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array, KVCaches]:
        """embeds: [T, D] the target's embeddings of tokens p+1; h: [T, D] the feature at p
        (the target's final hidden state, or the block's own output for later drafts);
        positions: i32[T], p -> (shared_head.norm(x) [T, D], x [T, D], kv_caches)."""
        parts = [self.enorm(embeds), self.hnorm(h.astype(embeds.dtype))]
        x = self.eh_proj(jnp.concatenate(parts[::-1] if self.hidden_first else parts, axis=-1))
        k_cache, v_cache = kv_caches  # its one layer's
        md = md.at_layer(0, k_cache, 1)
        x, k_cache, v_cache = self.layers[0](x, positions, k_cache, v_cache, md)
        return self.shared_head_norm(x), x, (k_cache, v_cache)

    @classmethod
    def hf_weight(cls, config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        """`model.layers.{L}.`'s enorm, hnorm, eh_proj and shared_head.norm; the block's as
        the target family names its layer L's."""
        first = str(path[0])
        prefix = f"model.layers.{config.num_layers}"
        if first in ("enorm", "hnorm"):
            return HFWeight((f"{prefix}.{first}.weight",))
        if first == "shared_head_norm":
            return HFWeight((f"{prefix}.shared_head.norm.weight",))
        if first == "eh_proj":
            return HFWeight((f"{prefix}.eh_proj.weight",), np.transpose)
        return cls.target_cls.hf_weight(
            config, ("layers", config.num_layers, *path[2:]), kv_replicas
        )


class DeepSeekMTP(MtpHead):
    target_cls = DeepseekV3ForCausalLM


class DeepSeekV32MTP(MtpHead):
    target_cls = DeepseekV32ForCausalLM


class GlmMoeDsaMTP(MtpHead):
    target_cls = GlmMoeDsaForCausalLM  # its block a full indexer layer (past indexer_types)


class Glm4MoeMTP(MtpHead):
    target_cls = Glm4MoeForCausalLM
