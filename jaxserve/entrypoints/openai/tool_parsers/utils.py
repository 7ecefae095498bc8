"""What the tool parsers share (vLLM's `tool_parsers/utils.py`): reading JSON at a position,
the one serialization of arguments (`dumps`), markers that split content from calls, and the
partial-JSON scanner that streams a call while its JSON is still open.

The scanner (`json_prefix`, `scan_call_object`, `scan_json_calls`) says, for text that is still
being generated, which prefix of the final `dumps(arguments)` is already certain; a `ScanMemo`
keeps what earlier scans of the same growing text found, so each delta costs about its own
length.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json.decoder import scanstring
from typing import Any

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


def hold_back_markers(text: str, markers: tuple[str, ...]) -> str:
    """`text` without its longest suffix that could be the start of one of `markers`."""
    return min((hold_back_marker(text, m) for m in markers), key=len)


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


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> int:
    """The index of the earliest of `markers` in text[start:], -1 if none is there."""
    found = [at for at in (text.find(m, start) for m in markers) if at >= 0]
    return min(found, default=-1)


def streamed_content_before_any(text: str, markers: tuple[str, ...]) -> tuple[str, int]:
    """streamed_content_before where any of `markers` starts the calls: what could still
    become one of them is held back."""
    at = find_first(text, markers)
    content = text[:at] if at >= 0 else hold_back_markers(text, markers)
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
