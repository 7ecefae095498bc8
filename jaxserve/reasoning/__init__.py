"""Reasoning parsers (`--reasoning-parser deepseek_r1 | qwen3 | openai_gptoss`), vLLM-compatible."""

from jaxserve.reasoning import (
    deepseek_r1_reasoning_parser,
    gptoss_reasoning_parser,
    qwen3_reasoning_parser,
)
from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from jaxserve.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from jaxserve.reasoning.gptoss_reasoning_parser import GptOssReasoningParser
from jaxserve.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "GptOssReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "deepseek_r1_reasoning_parser",
    "gptoss_reasoning_parser",
    "qwen3_reasoning_parser",
]
