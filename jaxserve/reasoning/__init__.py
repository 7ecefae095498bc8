"""Reasoning parsers (`--reasoning-parser deepseek_r1 | deepseek_v3 | glm45 | kimi_k2 |
minimax_m2 | minimax_m2_append_think | qwen3 | openai_gptoss`), vLLM-compatible."""

from jaxserve.reasoning import (
    deepseek_r1_reasoning_parser,
    deepseek_v3_reasoning_parser,
    glm4_moe_reasoning_parser,
    gptoss_reasoning_parser,
    kimi_k2_reasoning_parser,
    minimax_m2_reasoning_parser,
    qwen3_reasoning_parser,
)
from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from jaxserve.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from jaxserve.reasoning.deepseek_v3_reasoning_parser import DeepSeekV3ReasoningParser
from jaxserve.reasoning.glm4_moe_reasoning_parser import Glm4MoeModelReasoningParser
from jaxserve.reasoning.gptoss_reasoning_parser import GptOssReasoningParser
from jaxserve.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser
from jaxserve.reasoning.minimax_m2_reasoning_parser import (
    MiniMaxM2AppendThinkReasoningParser,
    MiniMaxM2ReasoningParser,
)
from jaxserve.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ReasoningParser",
    "Glm4MoeModelReasoningParser",
    "GptOssReasoningParser",
    "KimiK2ReasoningParser",
    "MiniMaxM2AppendThinkReasoningParser",
    "MiniMaxM2ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "deepseek_r1_reasoning_parser",
    "deepseek_v3_reasoning_parser",
    "glm4_moe_reasoning_parser",
    "gptoss_reasoning_parser",
    "kimi_k2_reasoning_parser",
    "minimax_m2_reasoning_parser",
    "qwen3_reasoning_parser",
]
