"""OpenAI's harmony format (gpt-oss), read from a completion's text with its special tokens.

A gpt-oss completion is a run of assistant messages, each a header, `<|message|>`, a body and
a terminator: `<|end|>` (more messages follow, each opened by `<|start|>assistant`), and the
stop tokens `<|return|>` (the answer is done) or `<|call|>` (a tool call; the engine stops
there, so they seldom reach the text). The header names the channel and may name a recipient
and a content type, in either order:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>
    <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The first message's `<|start|>assistant` is the end of the prompt (the chat template's
generation prompt), so a completion usually opens with its header. Channels: `analysis`
(reasoning), `commentary` (tool calls, with a recipient `functions.NAME`, and preambles to the
user, without one), `final` (the answer). Reading needs `skip_special_tokens` off, which the
gpt-oss parsers ask for (`adjust_request`).
"""

from __future__ import annotations

import dataclasses
import re

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_TERMINATORS = (END, RETURN, CALL)
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclasses.dataclass
class Message:
    """One message of a completion. body: its text so far; done: its terminator was seen (or
    the text ended after it as a stop token would); header_done: `<|message|>` was seen."""

    channel: str | None
    recipient: str | None
    body: str
    header_done: bool
    done: bool

    @property
    def tool_name(self) -> str | None:
        """The function a tool call addresses (recipient `functions.NAME`), else None."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient.removeprefix("functions.")
        return None


def is_harmony(text: str) -> bool:
    """Whether text holds any harmony structure (else it is plain text)."""
    return MESSAGE in text or CHANNEL in text


def parse(text: str) -> list[Message]:
    """The messages of a completion's text, the last possibly unfinished (truncated, or
    still streaming: its header may be incomplete). Plain text before the first header is a
    message of no channel."""
    messages = []
    segments = text.split(START)
    for i, segment in enumerate(segments):
        if i == 0 and not segment:
            continue
        if i == 0 and not (MESSAGE in segment or CHANNEL in segment or "to=" in segment):
            # text before the first message's header (content a parser kept as it was)
            messages.append(Message(None, None, segment, True, len(segments) > 1))
            continue
        header, sep, rest = segment.partition(MESSAGE)
        header = header.removeprefix("assistant")
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        cut = min((p for p in (rest.find(t) for t in _TERMINATORS) if p >= 0), default=-1)
        body = rest if cut < 0 else rest[:cut]
        messages.append(
            Message(
                channel=channel.group(1) if channel else None,
                recipient=recipient.group(1) if recipient else None,
                body=body,
                header_done=bool(sep),
                done=cut >= 0,
            )
        )
    return messages


def sections(text: str) -> tuple[list[str], list[str | Message]]:
    """The messages of `text` whose header is complete: (the analysis messages' bodies, the
    rest in order: a tool call (a message to `functions.NAME`) as its Message, any other
    message as its body). Plain text without harmony tokens is one body."""
    if not is_harmony(text):
        return [], [text]
    reasoning: list[str] = []
    rest: list[str | Message] = []
    for message in parse(text):
        if not message.header_done:
            break  # the last message, its header still streaming
        if message.tool_name is not None:
            rest.append(message)
        elif message.channel == "analysis":
            reasoning.append(message.body)
        else:
            rest.append(message.body)
    return reasoning, rest


def join_bodies(pieces: list[str | Message], call=None) -> str:
    """`sections`' rest as text: consecutive bodies joined by newlines, each tool call
    replaced by call(message) (left out without `call`)."""
    out, last_body = "", False
    for piece in pieces:
        if isinstance(piece, str):
            out += ("\n" if last_body else "") + piece
            last_body = True
        elif call is not None:
            out += call(piece)
            last_body = False
    return out
