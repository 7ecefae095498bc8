"""The tool-parser interface (vLLM's `ToolParser`) and its registry; the JSON scanning the
parsers share is `utils.py`.

A parser turns model text into OpenAI tool calls, either all at once (`extract_tool_calls`) or
while the text streams in (`extract_tool_calls_streaming`, then `flush_streaming` at the end).

Streaming here is snapshot-based: each subclass says, for the text generated so far, which
content and which calls (name, and the part of the arguments JSON) are already certain
(`stream_snapshot`); the base class sends what is new since the previous delta. Only certain
text is ever sent, so the fragments of a call concatenate to exactly the `arguments` of the
non-streaming result. Arguments are always `json.dumps(args, ensure_ascii=False)` of the parsed
object; `utils.json_prefix` streams that form while the model's JSON is still open.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import ScanMemo

logger = logging.getLogger(__name__)

StreamSnapshot = tuple[str, list[tuple[str, str]]]
"""(certain content, [(name, certain prefix of the arguments JSON), ...] for calls whose name
is certain)."""


class ToolParser:
    """Base class: subclasses implement `extract_tool_calls` and `stream_snapshot`.

    One instance serves one request (it holds the streaming state). Streaming state, as vLLM
    names it: `prev_tool_call_arr` ({"name", "arguments"} per call seen; "arguments" is the
    parsed dict once the call's arguments are complete), `current_tool_id` (index of the last
    call whose name was sent, -1 before any), `current_tool_name_sent`, and
    `streamed_args_for_tool` (the argument text sent so far, per call).
    """

    def __init__(self, tokenizer: Any = None):
        self.model_tokenizer = tokenizer
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []
        self.streamed_content = ""
        self.request: ChatCompletionRequest | None = None  # the streamed request (its tools)
        self._memo = ScanMemo()

    def scan_memo(self, text: str) -> ScanMemo:
        """This stream's ScanMemo, checked against `text` (for `stream_snapshot`)."""
        return self._memo.sync(text)

    @cached_property
    def vocab(self) -> dict[str, int]:
        """The tokenizer's vocabulary ({} without a tokenizer); computed on first use."""
        get_vocab = getattr(self.model_tokenizer, "get_vocab", None)
        return get_vocab() if get_vocab is not None else {}

    def special_token_id(self, token: str) -> int | None:
        """The id of `token` in the tokenizer's vocabulary, None when absent or no tokenizer."""
        return self.vocab.get(token)

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Change the request before generation (e.g. keep special tokens); default: as is."""
        return request

    def new_tool_call_id(self) -> str:
        return random_tool_call_id()

    def stream_tool_call_id(self, index: int) -> str:
        """The id of the `index`th streamed call, sent with its name (default: a new one)."""
        return self.new_tool_call_id()

    def marks_special(self, *tokens: str) -> bool:
        """Whether the tokenizer marks any of `tokens` as a special token (decoding with
        skip_special_tokens would then drop it)."""
        added = getattr(self.model_tokenizer, "added_tokens_decoder", None) or {}
        return any(
            getattr(t, "content", None) in tokens and getattr(t, "special", False)
            for t in added.values()
        )

    def make_tool_call(self, name: str, arguments: str) -> ToolCall:
        return ToolCall(
            function=FunctionCall(name=name, arguments=arguments), id=self.new_tool_call_id()
        )

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        """The calls in a whole completion; if it does not parse, no calls and the whole text."""
        raise NotImplementedError

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        """What of `text` (a completion still being generated) is certain; see StreamSnapshot.
        Whatever it returns must be a prefix of what the finished text gives."""
        raise NotImplementedError

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int] = (),
        current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
        request: ChatCompletionRequest | None = None,
    ) -> DeltaMessage | None:
        """The delta to send now that the text is `current_text`, None if nothing is new."""
        self.request = request
        try:
            content, calls = self.stream_snapshot(current_text)
        except Exception:  # a parser bug must not kill the stream
            logger.exception("%s failed on streamed text", type(self).__name__)
            return None
        return self._delta(content, calls, final=False)

    def flush_streaming(
        self, current_text: str, request: ChatCompletionRequest | None = None
    ) -> DeltaMessage | None:
        """At the end of the stream: what is still unsent of the final reading of the text.

        A call first named here carries its name and all its arguments in one DeltaToolCall.
        If calls were streamed but the finished text does not parse (e.g. cut off by
        max_tokens), nothing more is sent.
        """
        try:
            info = self.extract_tool_calls(current_text, request)
        except Exception:
            logger.exception("%s failed on the finished text", type(self).__name__)
            return None
        if not info.tools_called:
            if self.prev_tool_call_arr:
                return None
            return self._delta(info.content or "", [], final=True)
        calls = [(tc.function.name, tc.function.arguments) for tc in info.tool_calls]
        return self._delta(info.content or "", calls, final=True)

    def _delta(
        self, content: str, calls: list[tuple[str, str]], final: bool
    ) -> DeltaMessage | None:
        """What `content` and `calls` add to what was sent; updates the streaming state."""
        delta = DeltaMessage()
        sent = self.streamed_content
        if len(content) > len(sent) and content.startswith(sent):
            delta.content = content[len(sent) :]
            self.streamed_content = content
        tool_deltas: list[DeltaToolCall] = []
        for i, (name, args) in enumerate(calls):
            if i == len(self.prev_tool_call_arr):  # a new call: its first delta names it
                self.prev_tool_call_arr.append({"name": name})
                self.streamed_args_for_tool.append("")
                self.current_tool_id = i
                self.current_tool_name_sent = True
                function = DeltaFunctionCall(name=name)
                if final and args:
                    function.arguments = args
                    self.streamed_args_for_tool[i] = args
                tool_deltas.append(
                    DeltaToolCall(
                        index=i, id=self.stream_tool_call_id(i), type="function", function=function
                    )
                )
            elif self.prev_tool_call_arr[i]["name"] == name:
                sent = self.streamed_args_for_tool[i]
                if len(args) > len(sent) and args.startswith(sent):
                    fragment = args[len(sent) :]
                    tool_deltas.append(
                        DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=fragment))
                    )
                    self.streamed_args_for_tool[i] = args
            self._record_arguments(i, args)
        if tool_deltas:
            delta.tool_calls = tool_deltas
        return delta if delta.content is not None or tool_deltas else None

    def _record_arguments(self, i: int, args: str) -> None:
        entry = self.prev_tool_call_arr[i]
        if "arguments" not in entry and args.endswith("}"):
            with contextlib.suppress(ValueError):
                entry["arguments"] = json.loads(args)


class UnknownToolParserError(KeyError, ValueError):
    """No parser of that name (a KeyError and a ValueError, so either `except` catches it)."""

    def __str__(self) -> str:
        return str(self.args[0])


class ToolParserManager:
    """The registry of tool parsers by name (vLLM's `--tool-call-parser` names)."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(
        cls,
        name: str | list[str] | None = None,
        force: bool = True,
        module: type[ToolParser] | None = None,
    ) -> Any:
        """Register `module` under `name` (one or several; default: the class name). Without
        `module`, a class decorator. `force=False` refuses to replace a registered name."""

        def register(parser_cls: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolParser)):
                raise TypeError(f"{parser_cls!r} is not a ToolParser subclass")
            names = [name] if isinstance(name, str) else name or [parser_cls.__name__]
            for n in names:
                if not force and n in cls.tool_parsers:
                    raise KeyError(f"tool parser {n!r} is already registered")
                cls.tool_parsers[n] = parser_cls
            return parser_cls

        return register(module) if module is not None else register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        try:
            return cls.tool_parsers[name]
        except KeyError:
            known = ", ".join(cls.list_names())
            raise UnknownToolParserError(
                f"unknown tool parser {name!r}; known parsers: {known}"
            ) from None

    @classmethod
    def list_names(cls) -> list[str]:
        return sorted(cls.tool_parsers)


def no_tool_calls(model_output: str) -> ExtractedToolCallInformation:
    return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
