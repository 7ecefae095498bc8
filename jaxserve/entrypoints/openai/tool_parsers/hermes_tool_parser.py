"""Hermes-format tool calls (`hermes`): Hermes-2-Pro, Qwen2.5, Qwen3 and others.

The model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
possibly several, possibly after some text (the content). The last block may lack its
`</tool_call>` (a stop string, or EOS right after the JSON): its JSON object is read and what
follows it ignored. Text after the first block that is not in a block is ignored.
"""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ExtractedToolCallInformation
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import (
    call_from_object,
    content_before,
    read_json,
    scan_call_object,
    skip_ws,
    streamed_content_before,
)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep special tokens when the tokenizer marks `<tool_call>` as one (some Hermes
        tokenizers do; Qwen's do not), or detokenization would drop it."""
        if request.tools and request.tool_choice != "none" and self._start_is_special():
            request.skip_special_tokens = False
        return request

    def _start_is_special(self) -> bool:
        added = getattr(self.model_tokenizer, "added_tokens_decoder", None) or {}
        return any(
            getattr(t, "content", None) == self.tool_call_start_token and getattr(t, "special", 0)
            for t in added.values()
        )

    def _blocks(self, text: str, start: int) -> list[tuple[int, int]]:
        """(body start, body end or -1 for an open last block) of each block from `start`."""
        blocks = []
        while start >= 0:
            body = start + len(self.tool_call_start_token)
            end = text.find(self.tool_call_end_token, body)
            blocks.append((body, end))
            start = -1 if end < 0 else text.find(self.tool_call_start_token, end)
        return blocks

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        start = model_output.find(self.tool_call_start_token)
        if start < 0:
            return no_tool_calls(model_output)
        tool_calls = []
        for body, end in self._blocks(model_output, start):
            try:
                if end >= 0:
                    call = call_from_object(json.loads(model_output[body:end]))
                else:  # the open last block: its JSON object, whatever follows it
                    call = call_from_object(read_json(model_output, body)[0])
            except ValueError:
                call = None
            if call is None:
                return no_tool_calls(model_output)
            tool_calls.append(self.make_tool_call(*call))
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=tool_calls,
            content=content_before(model_output, self.tool_call_start_token),
        )

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        content, start = streamed_content_before(text, self.tool_call_start_token)
        calls: list[tuple[str, str]] = []
        if start < 0:
            return content, calls
        memo = self.scan_memo(text)
        for body, end in self._blocks(text, start):
            try:
                if end >= 0:  # a closed block: all of it or nothing
                    call = memo.entries.get(("block", body))
                    if call is None:
                        call = call_from_object(json.loads(text[body:end]))
                        if call is None:
                            break
                        memo.entries["block", body] = call
                    calls.append(call)
                    continue
                pos = skip_ws(text, body)
                if pos >= len(text) or text[pos] != "{":
                    break
                name, args, _ = scan_call_object(text, pos, memo=memo)
            except ValueError:
                break
            if name is not None:
                calls.append((name, args))
        return content, calls
