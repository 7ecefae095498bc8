"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's MLA, experts and sparse attention
(models/deepseek_v32.py) with two differences, as transformers' GlmMoeDsa: the indexer's
rotary turns interleaved pairs (V3.2's halves), and layers marked "shared" in the config's
`indexer_types` have no indexer, attending to the tokens the last "full" layer before them
chose. That choice passes from layer to layer within one forward's trace (SHARED_TOPK, set
for each call of the model and reset after it)."""

from __future__ import annotations

from jaxserve.models.deepseek_v32 import SHARED_TOPK, DeepseekV32ForCausalLM, DSAAttention
from jaxserve.models.llama import DecoderLayer


class GlmDSAAttention(DSAAttention):
    index_interleave = True


class GlmMoeDsaDecoderLayer(DecoderLayer):
    attention_cls = GlmDSAAttention


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: V3.2 with an interleaved indexer rotary and top-k shared across layers."""

    layer_cls = GlmMoeDsaDecoderLayer

    def __call__(self, *args, **kwargs):
        """As the base's; no top-k crosses from one forward (or trace) into another."""
        token = SHARED_TOPK.set(None)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            SHARED_TOPK.reset(token)
