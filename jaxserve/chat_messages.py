"""The chat API's message bodies that parsers below the HTTP layer build: a response message
or streamed delta (`ChatMessage`, vLLM's `DeltaMessage` for a delta) and its tool calls.

They live here, under every other layer, because the reasoning parsers (`jaxserve/reasoning`)
return deltas and must not import the entrypoints; `entrypoints/openai/protocol.py` re-exports
them beside the rest of the OpenAI bodies.
"""

from __future__ import annotations

import uuid

import msgspec


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct):
    function: FunctionCall
    id: str = msgspec.field(default_factory=lambda: random_tool_call_id())
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None  # a fragment; the fragments of a call concatenate to JSON


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """One streamed piece of tool call `index`: the first carries id, type and name; later
    ones only argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """A response message, or (every field optional) a streamed delta."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # the pre-Nov-2025 name of `reasoning`: both sent
    tool_calls: list[ToolCall] | list[DeltaToolCall] = msgspec.field(default_factory=list)


DeltaMessage = ChatMessage  # vLLM's name for a streamed delta
