"""GLM-4.5 / 4.6 (`glm45`): `[<think>]reasoning</think>content`, thinking on by default.

As vLLM's (its DeepSeek-V3 parser defaulting to thinking): unless chat_template_kwargs sets
`thinking` or `enable_thinking`, the output is read as deepseek_r1 reads it (the text before
the first `</think>` is reasoning, a leading `<think>` stripped; without `</think>`, all of it).
When either is set, thinking is on only if one of them is true; off, the template closes an
empty thought in the prompt and all of the output is content.
"""

from __future__ import annotations

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParserManager
from jaxserve.reasoning.deepseek_v3_reasoning_parser import DeepSeekV3ReasoningParser


@ReasoningParserManager.register_module("glm45")
class Glm4MoeModelReasoningParser(DeepSeekV3ReasoningParser):
    default_thinking = True
