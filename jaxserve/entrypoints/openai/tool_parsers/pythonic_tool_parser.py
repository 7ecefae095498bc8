"""Pythonic tool calls (`pythonic`, `llama4_pythonic`): Llama 3.2 / 4, ToolACE and others.

The whole completion is a Python list of calls with keyword arguments,
`[get_weather(city='Paris', unit="c"), get_time(tz="CET")]`, optionally between Llama 4's
`<|python_start|>` and `<|python_end|>`. It is read with `ast`; argument values must be
literals (strings, numbers, booleans, None, and lists, tuples and dicts of them), which become a
JSON object. Anything else is plain content. While streaming, a call is sent when its closing
parenthesis arrives.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ExtractedToolCallInformation
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import ScanMemo, dumps

_START, _END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_]\w*")
_SPACE = re.compile(r"\s*")
_BRACKET_OR_QUOTE = re.compile(r"""[()\[\]{}"']""")
# A string's body, up to its closing quote. In triple quotes a quote is body only where what
# follows shows that it does not close the string, so a trailing ' or '' waits for more text.
_STRING_BODY = {
    "'": re.compile(r"(?:[^'\\]|\\.)*", re.S),
    '"': re.compile(r'(?:[^"\\]|\\.)*', re.S),
    "'''": re.compile(r"(?:[^'\\]|\\.|'(?=[^']|'[^']))*", re.S),
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?=[^"]|"[^"]))*', re.S),
}
_CLOSING = {"(": ")", "[": "]", "{": "}"}


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON-able value of a literal expression; _NotLiteral for anything else."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, bool | int | float | str):
            return node.value
    elif isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        if None in node.keys:  # {**x}
            raise _NotLiteral
        keys = [_literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise _NotLiteral
        return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    elif (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub | ast.UAdd)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    raise _NotLiteral


def _call(node: ast.expr) -> tuple[str, str] | None:
    """(name, arguments JSON) of `name(key=literal, ...)`, None for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    except _NotLiteral:
        return None
    if len(args) != len(node.keywords):  # a **kwargs
        return None
    return node.func.id, dumps(args)


def _parse_call(source: str) -> tuple[str, str] | None:
    try:
        return _call(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _close_paren(text: str, start: int, memo: ScanMemo | None = None) -> int | None:
    """Index past the bracket matching `text[start]` (skipping strings); None if it is not in
    `text` yet. ValueError on a mismatched bracket. The memo keeps where the scan got to."""
    key = ("paren", start)
    state = memo.entries.get(key) if memo is not None else None
    pos, stack, quote = state or (start, (), None)
    stack = list(stack)
    while True:
        if quote is not None:  # inside a string
            pos = _STRING_BODY[quote].match(text, pos).end()
            if not text.startswith(quote, pos):
                break
            pos, quote = pos + len(quote), None
        m = _BRACKET_OR_QUOTE.search(text, pos)
        if m is None:
            pos = len(text)
            break
        c, pos = m.group(), m.end()
        if c in _CLOSING:
            stack.append(_CLOSING[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                raise ValueError(f"mismatched {c!r}")
            if not stack:
                return pos
        elif (c * 3).startswith(text[m.start() :]):  # ' or '' at the end: may become '''
            pos = m.start()
            break
        else:
            quote = c * 3 if text.startswith(c * 3, m.start()) else c
            pos = m.start() + len(quote)
    if memo is not None:
        memo.entries[key] = (pos, tuple(stack), quote)
    return None


@ToolParserManager.register_module(["pythonic", "llama4_pythonic"])
class PythonicToolParser(ToolParser):
    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        text = model_output.strip()
        if text.startswith(_START):
            text = text[len(_START) :].removesuffix(_END).strip()
        if not text.startswith("["):
            return no_tool_calls(model_output)
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return no_tool_calls(model_output)
        if not isinstance(tree, ast.List) or not tree.elts:
            return no_tool_calls(model_output)
        calls = [_call(node) for node in tree.elts]
        if None in calls:
            return no_tool_calls(model_output)
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[self.make_tool_call(*call) for call in calls],
            content=None,
        )

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        pos = _SPACE.match(text).end()
        if len(text) - pos < len(_START) and _START.startswith(text[pos:]):  # maybe the tag
            return "", []
        if text.startswith(_START, pos):
            pos = _SPACE.match(text, pos + len(_START)).end()
            if pos == len(text):
                return "", []
        if not text.startswith("[", pos):
            return text, []
        memo = self.scan_memo(text)
        calls: list[tuple[str, str]] = []
        pos += 1
        while True:  # one `name(...)` per turn; (text, []) where it cannot be calls
            pos = _SPACE.match(text, pos).end()
            done = memo.entries.get(("call", pos))
            if done is None:
                done = self._read_call(text, pos, memo)
                if done is None:
                    return "", calls  # wait for more
                if done == "not a call":
                    return ("", calls) if calls else (text, [])
                memo.entries["call", pos] = done
            call, pos = done
            calls.append(call)
            pos = _SPACE.match(text, pos).end()
            if not text.startswith(",", pos):
                return "", calls
            pos += 1

    @staticmethod
    def _read_call(text: str, pos: int, memo: ScanMemo) -> Any:
        """((name, arguments), end) for the call at `pos`, None if it is not complete yet, or
        "not a call" if it cannot be one."""
        m = _IDENT.match(text, pos)
        if m is None:
            return None if pos == len(text) else "not a call"
        paren = _SPACE.match(text, m.end()).end()
        if paren == len(text):
            return None
        if text[paren] != "(":
            return "not a call"
        try:
            end = _close_paren(text, paren, memo)
        except ValueError:
            return "not a call"
        if end is None:
            return None
        call = _parse_call(text[pos:end])
        return "not a call" if call is None else (call, end)
