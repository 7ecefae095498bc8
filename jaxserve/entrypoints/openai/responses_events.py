"""/v1/responses' output (serving_responses.py): a finished choice's message as output items,
and the Responses event stream of a streamed one (`event:` + `data:`, every event with a rising
sequence_number) as its items are opened, grow and close."""

from __future__ import annotations

import msgspec

from jaxserve.entrypoints.openai.protocol import ChatMessage, DeltaToolCall, random_tool_call_id
from jaxserve.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    item_id,
)

_json = msgspec.json.Encoder()


def output_items(message: ChatMessage, logprobs: list) -> list:
    """A finished choice's message as output items: reasoning, text, function calls."""
    items: list = []
    if message.reasoning:
        items.append(ReasoningItem(item_id("rs"), [ReasoningText(message.reasoning)]))
    if message.content:
        items.append(
            OutputMessage(item_id("msg"), [OutputText(message.content, logprobs=logprobs)])
        )
    for call in message.tool_calls:
        items.append(
            FunctionCallItem(item_id("fc"), call.id, call.function.name, call.function.arguments)
        )
    return items


class ResponseEvents:
    """The event stream of one response: its sequence numbers, and the output items as
    they are opened (output_item.added, content_part.added), grow (deltas) and close."""

    def __init__(self):
        self.sequence_number = 0
        self.items: list = []
        self.current = None  # the open item
        self.call_index = None  # the open function call's index among the tool calls

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"

    def delta(self, delta: ChatMessage | None, logprobs: list) -> list[bytes]:
        """A parsed delta's events; `logprobs` go with its text, if it has any."""
        if delta is None:
            return []
        out = []
        if delta.reasoning:
            out += self._text(ReasoningItem, delta.reasoning)
        if delta.content:
            out += self._text(OutputMessage, delta.content, logprobs)
        for call in delta.tool_calls:
            out += self._call(call)
        return out

    def _open(self, item) -> list[bytes]:
        out = self.close("completed")
        self.items.append(item)
        self.current = item
        shown = msgspec.structs.replace(item, status="in_progress")
        if not isinstance(item, FunctionCallItem):
            shown = msgspec.structs.replace(shown, content=[])
        return out + [
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=shown)
        ]

    def _where(self) -> dict:
        return {"item_id": self.current.id, "output_index": len(self.items) - 1}

    def _text(self, cls, text: str, logprobs: list | tuple = ()) -> list[bytes]:
        out = []
        message = cls is OutputMessage
        if not isinstance(self.current, cls):
            part = OutputText("") if message else ReasoningText("")
            out += self._open(cls(item_id("msg" if message else "rs"), [part]))
            out.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        self.current.content[0].text += text
        if message:
            self.current.content[0].logprobs += logprobs
            out.append(
                self.event(
                    "response.output_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=text,
                    logprobs=logprobs,
                )
            )
        else:
            out.append(
                self.event(
                    "response.reasoning_text.delta", **self._where(), content_index=0, delta=text
                )
            )
        return out

    def _call(self, call: DeltaToolCall) -> list[bytes]:
        out = []
        fn = call.function
        if call.id is not None or not (
            isinstance(self.current, FunctionCallItem) and self.call_index == call.index
        ):
            name = (fn.name if fn is not None else None) or ""
            item = FunctionCallItem(item_id("fc"), call.id or random_tool_call_id(), name, "")
            out += self._open(item)
            self.call_index = call.index
        arguments = fn.arguments if fn is not None else None
        if arguments:
            self.current.arguments += arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta", **self._where(), delta=arguments
                )
            )
        return out

    def close(self, status: str) -> list[bytes]:
        """The open item's closing events (it ends with `status`)."""
        item = self.current
        if item is None:
            return []
        where, out = self._where(), []
        if isinstance(item, FunctionCallItem):
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    arguments=item.arguments,
                    name=item.name,
                )
            )
        else:
            part = item.content[0]
            if isinstance(item, OutputMessage):
                out.append(
                    self.event(
                        "response.output_text.done",
                        **where,
                        content_index=0,
                        text=part.text,
                        logprobs=part.logprobs,
                    )
                )
            else:
                out.append(
                    self.event(
                        "response.reasoning_text.done", **where, content_index=0, text=part.text
                    )
                )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        item.status = status
        out.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        self.current = self.call_index = None
        return out
