"""The tool-parser interface (vLLM's `ToolParser`), its registry, and shared JSON helpers.

A parser turns model text into OpenAI tool calls, either all at once (`extract_tool_calls`) or
while the text streams in (`extract_tool_calls_streaming`, then `flush_streaming` at the end).

Streaming here is snapshot-based: each subclass says, for the text generated so far, which
content and which calls (name, and the part of the arguments JSON) are already certain
(`stream_snapshot`); the base class sends what is new since the previous delta. Only certain
text is ever sent, so the fragments of a call concatenate to exactly the `arguments` of the
non-streaming result. Arguments are always `json.dumps(args, ensure_ascii=False)` of the parsed
object; `json_prefix` streams that form while the model's JSON is still open.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from functools import cached_property
from json.decoder import scanstring
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
                        index=i, id=self.new_tool_call_id(), type="function", function=function
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


# ------------------------------------------------------------------ shared helpers
_DECODER = json.JSONDecoder()
_JSON_WS = re.compile(r"[ \t\n\r]*")
_NUMBER_OR_LITERAL_PREFIX = re.compile(
    r"-?(\d+(\.\d*)?([eE][+-]?\d*)?)?|-?I(n(f(i(n(i(ty?)?)?)?)?)?)?|N(aN?)?|t(r(ue?)?)?"
    r"|f(a(l(se?)?)?)?|n(u(ll?)?)?"
)


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-JSON-whitespace character at or after `pos`."""
    return _JSON_WS.match(text, pos).end()


def read_json(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at `text[pos:]` (after whitespace) and the index past it; whatever
    follows is left alone. ValueError if there is no complete value."""
    return _DECODER.raw_decode(text, skip_ws(text, pos))


def dumps(value: Any) -> str:
    """The one serialization of arguments used everywhere (so streaming matches)."""
    return json.dumps(value, ensure_ascii=False)


def arguments_json(value: Any) -> str | None:
    """Arguments as a JSON object string: a dict, or a string holding a JSON object (some
    models encode arguments that way); None for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return dumps(value) if isinstance(value, dict) else None


def call_from_object(
    obj: Any, arg_keys: tuple[str, ...] = ("arguments",), require_args: bool = False
) -> tuple[str, str] | None:
    """(name, arguments JSON) of a {"name": ..., "<arg key>": {...}} object, None if it is not
    one. Missing arguments are "{}" unless `require_args`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arg_keys if k in obj), None)
    if key is None:
        return None if require_args else (obj["name"], "{}")
    args = arguments_json(obj[key])
    return None if args is None else (obj["name"], args)


def hold_back_marker(text: str, marker: str) -> str:
    """`text` without its longest suffix that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def content_before(text: str, marker: str) -> str | None:
    """Content of a finished text whose calls start at `marker`: the text before it, None if
    that is only whitespace."""
    content = text[: text.find(marker)]
    return content if content.strip() else None


def streamed_content_before(text: str, marker: str) -> tuple[str, int]:
    """For text still streaming: (certain content, index of `marker` or -1). Content before the
    marker that is only whitespace is held back (it becomes None if a call follows)."""
    at = text.find(marker)
    content = text[:at] if at >= 0 else hold_back_marker(text, marker)
    return (content if content.strip() else ""), at


class ScanMemo:
    """What scans of a streamed text found so far (keyed by what and where), reused while the
    text only grows: each delta then costs about its own length, not the whole text's."""

    def __init__(self) -> None:
        self.text = ""
        self.entries: dict[Any, Any] = {}

    def sync(self, text: str) -> ScanMemo:
        """Forget everything unless `text` extends the text of the previous scan."""
        if not text.startswith(self.text):
            self.entries.clear()
        self.text = text
        return self


def json_prefix(text: str, pos: int, memo: ScanMemo | None = None) -> tuple[str, int | None]:
    """For the JSON value at `text[pos:]` (after whitespace), possibly still incomplete:
    (the start of `dumps(value)` already certain, index just past the value or None while it
    is incomplete). ValueError if the text cannot start a valid JSON value."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return "", None
    c = text[pos]
    if c in "{[":
        return _container_prefix(text, pos, memo)
    if c == '"':
        return _string_prefix(text, pos, memo)
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        if _NUMBER_OR_LITERAL_PREFIX.fullmatch(text, pos):
            return "", None
        raise
    if end < len(text) and text[end] not in ".eE+-0123456789":
        return dumps(value), end
    return "", None  # a number that may go on


def _string_prefix(text: str, pos: int, memo: ScanMemo | None) -> tuple[str, int | None]:
    """json_prefix of the string at `text[pos]`. The memo keeps how far its text is decoded
    (always at an escape boundary), so a later call decodes only what is new."""
    key = ("json", pos)
    raw, out = memo.entries.get(key, (pos + 1, '"')) if memo is not None else (pos + 1, '"')
    try:
        s, end = scanstring(text, raw)
        return out + dumps(s)[1:], end
    except ValueError:
        pass  # not terminated yet (or bad)
    body = text[raw:]
    for cut in range(min(6, len(body)) + 1):  # drop an incomplete escape at the end
        chunk = body[: len(body) - cut]
        try:
            s = json.loads('"' + chunk + '"')
        except ValueError:
            continue
        raw += len(chunk)
        if s and "\ud800" <= s[-1] <= "\udbff":  # a low surrogate may follow and join it
            raw -= 1 if chunk.endswith(s[-1]) else 6
            s = s[:-1]
        out += dumps(s)[1:-1]
        if memo is not None:
            memo.entries[key] = (raw, out)
        return out, None
    raise ValueError(f"bad JSON string at {pos}")


def _container_prefix(text: str, start: int, memo: ScanMemo | None) -> tuple[str, int | None]:
    """json_prefix of the object or array at `text[start]`. The memo keeps, per container,
    the output up to its last finished element, so a later call resumes there."""
    key = ("json", start)
    close = "}" if text[start] == "{" else "]"
    cached = memo.entries.get(key) if memo is not None else None
    if cached is not None:
        done, pos, complete = cached
        if complete:
            return done, pos
        out = [done]
    else:
        out = [text[start]]
        pos = skip_ws(text, start + 1)
        if text.startswith(close, pos):
            return text[start] + close, pos + 1
    done_len, done_pos = 1, pos
    while True:
        pos = skip_ws(text, pos)
        if close == "}":
            if pos >= len(text):
                break
            if text[pos] != '"':
                raise ValueError(f"expected a key at {pos}")
            try:
                name, pos = scanstring(text, pos + 1)
            except ValueError:
                break  # the key is not finished
            pos = skip_ws(text, pos)
            if pos >= len(text):
                break
            if text[pos] != ":":
                raise ValueError(f"expected ':' at {pos}")
            out.append(dumps(name) + ": ")
            pos += 1
        value, end = json_prefix(text, pos, memo)
        out.append(value)
        if end is None:
            break
        pos = skip_ws(text, end)
        if pos >= len(text):
            break
        if text[pos] == close:  # decode it whole: duplicate keys collapse as in json.loads
            result = dumps(_DECODER.raw_decode(text, start)[0]), pos + 1
            if memo is not None:
                memo.entries[key] = (*result, True)
            return result
        if text[pos] != ",":
            raise ValueError(f"expected ',' at {pos}")
        out.append(", ")
        pos += 1
        done_len, done_pos = len(out), pos
    if memo is not None and done_len > 1:
        memo.entries[key] = ("".join(out[:done_len]), done_pos, False)
    return "".join(out), None


def scan_call_object(
    text: str,
    pos: int,
    arg_keys: tuple[str, ...] = ("arguments",),
    require_args: bool = False,
    memo: ScanMemo | None = None,
) -> tuple[str | None, str, int | None]:
    """Read a {"name": ..., "arguments": {...}} call object starting at `text[pos]` ("{"),
    possibly incomplete: (name if certain, certain prefix of the arguments JSON, index past
    the object or None while it is incomplete). With `require_args`, the name only counts once
    an arguments key has been seen. ValueError if it cannot become a valid call."""
    key = ("call", pos)
    if memo is not None and key in memo.entries:
        return memo.entries[key]
    start = pos
    name, args, has_args = None, "", False
    pos = skip_ws(text, pos + 1)
    while pos < len(text):
        if text[pos] != '"':
            raise ValueError(f"expected a key at {pos}")
        try:
            field, pos = scanstring(text, pos + 1)
        except ValueError:
            break
        pos = skip_ws(text, pos)
        if pos >= len(text):
            break
        if text[pos] != ":":
            raise ValueError(f"expected ':' at {pos}")
        value_at = skip_ws(text, pos + 1)
        value, end = json_prefix(text, value_at, memo)
        if field in arg_keys and not has_args:
            has_args = True
            if text.startswith("{", value_at):
                args = value
            elif end is not None:  # e.g. arguments as a JSON string: only once complete
                args = arguments_json(json.loads(text[value_at:end])) or ""
        if end is None:
            break
        if field == "name":
            name = json.loads(text[value_at:end])
            if not isinstance(name, str) or not name:
                raise ValueError("the name is not a non-empty string")
        pos = skip_ws(text, end)
        if pos >= len(text):
            break
        if text[pos] == "}":  # complete: read it as the whole-text parsers do
            obj, end = _DECODER.raw_decode(text, start)
            call = call_from_object(obj, arg_keys, require_args)
            if call is None:
                raise ValueError("not a tool call object")
            result = (*call, end)
            if memo is not None:
                memo.entries[key] = result
            return result
        if text[pos] != ",":
            raise ValueError(f"expected ',' at {pos}")
        pos = skip_ws(text, pos + 1)
    if require_args and not has_args:
        name = None
    return name, args, None


def scan_json_calls(
    text: str,
    pos: int,
    separator: str,
    read: Callable[[str, int], tuple[str | None, str, int | None]],
) -> list[tuple[str, str]]:
    """Streamed calls from a run of call objects starting at `text[pos]`, separated by
    `separator` (e.g. "," in a JSON array): the calls whose name is certain, with their certain
    arguments. `read` is `scan_call_object` or similar. Stops quietly at anything else."""
    calls: list[tuple[str, str]] = []
    try:
        while True:
            pos = skip_ws(text, pos)
            if pos >= len(text) or text[pos] != "{":
                return calls
            name, args, end = read(text, pos)
            if name is None:
                return calls
            calls.append((name, args))
            if end is None:
                return calls
            pos = skip_ws(text, end)
            if pos >= len(text) or text[pos] != separator:
                return calls
            pos += 1
    except ValueError:
        return calls


def no_tool_calls(model_output: str) -> ExtractedToolCallInformation:
    return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
