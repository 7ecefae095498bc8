"""HF `architectures` name -> model class."""

from jaxserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from jaxserve.models.deepseek_v32 import DeepseekV32ForCausalLM
from jaxserve.models.eagle import Eagle3LlamaForCausalLM, EagleLlamaForCausalLM
from jaxserve.models.gemma import GemmaForCausalLM
from jaxserve.models.gemma4 import Gemma4ForCausalLM
from jaxserve.models.glm4_moe import Glm4MoeForCausalLM
from jaxserve.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from jaxserve.models.gpt_oss import GptOssForCausalLM
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration
from jaxserve.models.minimax_m2 import MiniMaxM2ForCausalLM
from jaxserve.models.mixtral import MixtralForCausalLM
from jaxserve.models.mtp import DeepSeekMTP, DeepSeekV32MTP, Glm4MoeMTP, GlmMoeDsaMTP
from jaxserve.models.phi3 import Phi3ForCausalLM
from jaxserve.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxserve.models.qwen3_moe import Qwen3MoeForCausalLM
from jaxserve.models.qwen3_next import Qwen3NextForCausalLM
from jaxserve.models.seq_cls import Qwen3ForSequenceClassification
from jaxserve.models.vlm import (
    Gemma3ForConditionalGeneration,
    Gemma4ForConditionalGeneration,
    LlavaForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + q/k norms (ModelConfig.qk_norm)
    # a score head on the last token (runner="pooling": classify, score, rerank)
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "Phi3ForCausalLM": Phi3ForCausalLM,  # fused qkv / gate_up checkpoints
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,  # text only
    "Gemma4ForCausalLM": Gemma4ForCausalLM,  # full layers wider, KV sharing, per-layer inputs
    "MixtralForCausalLM": MixtralForCausalLM,  # mixture of experts
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,  # whole-projection q/k norms, sigmoid routing
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,  # + q/k norms, some dense layers
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,  # partial rotary, noaux_tc routing, shared
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # MLA + GLM-4.5's experts (Kimi K2 too)
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,  # V3 + DeepSeek Sparse Attention
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,  # GLM-5: V3.2, top-k shared across layers
    "Llama4ForCausalLM": Llama4ForCausalLM,  # text: chunked attention, NoPE layers, top-1 MoE
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,  # MLA, softmax group-limited routing
    "Llama4ForConditionalGeneration": Llama4ForConditionalGeneration,  # its text model only
    "GptOssForCausalLM": GptOssForCausalLM,  # sinks, alternating windows, MXFP4 experts
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,  # gated delta-net + gated attention, hybrid
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,  # Qwen3-Next's layout, projections apart
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,  # + routed and gated shared experts
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,  # + its vision tower
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,  # DeepStack, Qwen3
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,  # + experts
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # CLIP + projector + Llama
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,  # M-RoPE, ViT
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # bidirectional images
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,  # images at their aspect
    "EagleLlamaForCausalLM": EagleLlamaForCausalLM,  # an EAGLE-1 draft head (spec decoding)
    "Eagle3LlamaForCausalLM": Eagle3LlamaForCausalLM,  # an EAGLE-3 draft head
    "DeepSeekMTPModel": DeepSeekMTP,  # DeepSeek-V3's multi-token-prediction layer (method mtp)
    "DeepSeekV32MTPModel": DeepSeekV32MTP,  # DeepSeek-V3.2's (a sparse-attention layer)
    "Glm4MoeMTPModel": Glm4MoeMTP,  # GLM-4.5's
    "GlmMoeDsaMTPModel": GlmMoeDsaMTP,  # GLM-5's (a full indexer layer)
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(sorted(_MODELS))}"
        ) from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
