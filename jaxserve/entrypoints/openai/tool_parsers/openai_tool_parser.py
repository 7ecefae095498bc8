"""gpt-oss's tool calls (`openai`): harmony messages to `functions.NAME` (reasoning.harmony).

A call is a commentary message whose recipient is `functions.NAME` and whose body is the
arguments' JSON. The text it reads is either the content the `openai_gptoss` reasoning parser
left (final text, preambles and the calls kept as harmony) or, without that parser, the whole
completion, whose analysis messages are then dropped. The content is the bodies of the other
messages (final answers, commentary preambles), joined by newlines; plain text without
harmony tokens is content with no calls. Arguments are the JSON re-serialized, as every parser
here gives them (a body that is not JSON is passed through as written).
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
from jaxserve.entrypoints.openai.tool_parsers.utils import dumps, json_prefix
from jaxserve.reasoning import harmony


@ToolParserManager.register_module("openai")
class OpenAIToolParser(ToolParser):
    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Harmony's structure is special tokens: keep them in the text, unspaced."""
        request.skip_special_tokens = False
        request.spaces_between_special_tokens = False
        return request

    @staticmethod
    def _read(text: str) -> tuple[str, list[harmony.Message]]:
        """(content, the tool-call messages whose header is complete) of text."""
        _, rest = harmony.sections(text)
        return harmony.join_bodies(rest), [m for m in rest if isinstance(m, harmony.Message)]

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        content, calls = self._read(model_output)
        if not calls:
            return no_tool_calls(content)
        tool_calls = [self.make_tool_call(m.tool_name, _arguments(m.body)) for m in calls]
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=tool_calls, content=content or None
        )

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        content, calls = self._read(text)
        snapshot = []
        for message in calls:
            if message.done:
                snapshot.append((message.tool_name, _arguments(message.body)))
                continue
            try:  # the certain start of the arguments' JSON
                prefix, _ = json_prefix(message.body, 0)
            except ValueError:  # not JSON: held until the call ends
                prefix = ""
            snapshot.append((message.tool_name, prefix))
        return content, snapshot


def _arguments(body: str) -> str:
    """A call's arguments: its JSON body re-serialized, or the body as written."""
    try:
        return dumps(json.loads(body))
    except ValueError:
        return body.strip()
