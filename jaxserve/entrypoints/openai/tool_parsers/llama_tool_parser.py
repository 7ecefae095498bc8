"""Llama 3.x / 4 JSON tool calls (`llama3_json`, `llama4_json`).

The whole completion is the calls: an optional `<|python_tag|>`, then one or more objects
`{"name": ..., "parameters": {...}}` ("arguments" is accepted too) separated by `;`. A text that
(stripped) starts with neither `{` nor the tag, or does not parse that way, is plain content.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ExtractedToolCallInformation
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import (
    call_from_object,
    read_json,
    scan_call_object,
    scan_json_calls,
    skip_ws,
)

_ARG_KEYS = ("arguments", "parameters")


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"

    def _calls_start(self, text: str) -> int | None:
        """Where the JSON of the calls starts; None if `text` is not calls (yet)."""
        start = len(text) - len(text.lstrip())
        if text.startswith(self.bot_token, start):
            return start + len(self.bot_token)
        return start if text.startswith("{", start) else None

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        text = model_output.rstrip()
        pos = self._calls_start(text)
        if pos is None:
            return no_tool_calls(model_output)
        tool_calls = []
        try:
            while True:
                obj, pos = read_json(text, pos)
                call = call_from_object(obj, _ARG_KEYS, require_args=True)
                if call is None:
                    return no_tool_calls(model_output)
                tool_calls.append(self.make_tool_call(*call))
                pos = skip_ws(text, pos)
                if pos == len(text):
                    break
                if text[pos] != ";":
                    return no_tool_calls(model_output)
                pos = skip_ws(text, pos + 1)
                if pos == len(text):  # a trailing ";"
                    break
        except ValueError:
            return no_tool_calls(model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=tool_calls, content=None)

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        pos = self._calls_start(text)
        if pos is None:
            rest = text.lstrip()
            if not rest or self.bot_token.startswith(rest):
                return "", []  # may still become calls
            return text, []
        memo = self.scan_memo(text)
        return "", scan_json_calls(
            text, pos, ";", lambda t, p: scan_call_object(t, p, _ARG_KEYS, True, memo)
        )
