"""Mistral tool calls (`mistral`).

Two forms follow the `[TOOL_CALLS]` control token (text before it is the content):
- a JSON array, `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral-7B-v0.3,
  Mixtral, Mistral-Nemo, Small 3);
- `[TOOL_CALLS]name[ARGS]{...}` or `[TOOL_CALLS]name{...}`, one token per call (newer models).
What follows the array, or a call's arguments object, is ignored. Call ids are 9 letters and
digits, as Mistral's chat template requires.
"""

from __future__ import annotations

import random
import re
import string

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ExtractedToolCallInformation
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import (
    arguments_json,
    call_from_object,
    content_before,
    json_prefix,
    read_json,
    scan_call_object,
    scan_json_calls,
    skip_ws,
    streamed_content_before,
)

_ID_CHARS = string.ascii_letters + string.digits
# A call's name is certain once `[ARGS]` or the arguments' "{" follows it.
_NAME = re.compile(r"\s*([\w.\-]+)\s*(?:\[ARGS\]|(?=\{))")


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    bot_token = "[TOOL_CALLS]"

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """`[TOOL_CALLS]` is a special token: keep special tokens when tools may be called."""
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def new_tool_call_id(self) -> str:
        return mistral_tool_call_id()

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        start = model_output.find(self.bot_token)
        if start < 0:
            return no_tool_calls(model_output)
        rest = model_output[start + len(self.bot_token) :]
        try:
            if rest[skip_ws(rest, 0) :].startswith("["):
                array, _ = read_json(rest, 0)
                calls = [call_from_object(obj) for obj in array]
            else:
                calls = [self._named_call(seg) for seg in rest.split(self.bot_token)]
        except ValueError:
            return no_tool_calls(model_output)
        if not calls or None in calls:
            return no_tool_calls(model_output)
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[self.make_tool_call(*call) for call in calls],
            content=content_before(model_output, self.bot_token),
        )

    @staticmethod
    def _named_call(segment: str) -> tuple[str, str] | None:
        m = _NAME.match(segment)
        if m is None:
            return None
        args = arguments_json(read_json(segment, m.end())[0])
        return None if args is None else (m.group(1), args)

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        content, start = streamed_content_before(text, self.bot_token)
        if start < 0:
            return content, []
        memo = self.scan_memo(text)
        pos = skip_ws(text, start + len(self.bot_token))
        if text.startswith("[", pos):
            return content, scan_json_calls(
                text, pos + 1, ",", lambda t, p: scan_call_object(t, p, memo=memo)
            )
        calls: list[tuple[str, str]] = []
        while start >= 0:  # one `[TOOL_CALLS]name[ARGS]{...}` per turn
            m = _NAME.match(text, start + len(self.bot_token))
            if m is None:
                break
            pos = skip_ws(text, m.end())
            if not text.startswith("{", pos):
                calls.append((m.group(1), ""))
                break
            try:
                args, end = json_prefix(text, pos, memo)
            except ValueError:
                break
            calls.append((m.group(1), args))
            if end is None:
                break
            start = text.find(self.bot_token, end)
        return content, calls
