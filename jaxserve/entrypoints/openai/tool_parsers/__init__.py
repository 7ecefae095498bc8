"""Tool-call parsers (vLLM's `--tool-call-parser`): model text to OpenAI tool calls.

`ToolParserManager.get_tool_parser(name)(tokenizer)` makes one parser per request. Importing
this package registers `hermes`, `llama3_json` / `llama4_json`, `mistral`, `pythonic` /
`llama4_pythonic`, `openai` (gpt-oss's harmony), `deepseek_v3`, `deepseek_v31`, `glm45` / `glm47`,
`deepseek_v32`, `kimi_k2`, `minimax_m2`, `qwen3_coder` and `qwen3_xml`.
"""

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)
from jaxserve.entrypoints.openai.tool_parsers.deepseekv3_tool_parser import DeepSeekV3ToolParser
from jaxserve.entrypoints.openai.tool_parsers.deepseekv31_tool_parser import DeepSeekV31ToolParser
from jaxserve.entrypoints.openai.tool_parsers.deepseekv32_tool_parser import DeepSeekV32ToolParser
from jaxserve.entrypoints.openai.tool_parsers.glm4_moe_tool_parser import Glm4MoeModelToolParser
from jaxserve.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from jaxserve.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from jaxserve.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from jaxserve.entrypoints.openai.tool_parsers.minimax_m2_tool_parser import MiniMaxM2ToolParser
from jaxserve.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from jaxserve.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser
from jaxserve.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from jaxserve.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser
from jaxserve.entrypoints.openai.tool_parsers.qwen3xml_tool_parser import Qwen3XMLToolParser

__all__ = [
    "DeepSeekV31ToolParser",
    "DeepSeekV32ToolParser",
    "DeepSeekV3ToolParser",
    "Glm4MoeModelToolParser",
    "Hermes2ProToolParser",
    "KimiK2ToolParser",
    "Llama3JsonToolParser",
    "MiniMaxM2ToolParser",
    "MistralToolParser",
    "OpenAIToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "Qwen3XMLToolParser",
    "ToolParser",
    "ToolParserManager",
]
