"""Tool-call parsers (vLLM's `--tool-call-parser`): model text to OpenAI tool calls.

`ToolParserManager.get_tool_parser(name)(tokenizer)` makes one parser per request. Importing
this package registers `hermes`, `llama3_json` / `llama4_json`, `mistral` and `pythonic` /
`llama4_pythonic` and `openai` (gpt-oss's harmony).
"""

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)
from jaxserve.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from jaxserve.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from jaxserve.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from jaxserve.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser
from jaxserve.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = [
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "OpenAIToolParser",
    "PythonicToolParser",
    "ToolParser",
    "ToolParserManager",
]
