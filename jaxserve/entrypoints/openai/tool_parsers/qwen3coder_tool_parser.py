"""Qwen3-Coder's XML tool calls (`qwen3_coder`; `qwen3_xml` is qwen3xml_tool_parser.py).

The model writes each call as

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

after the content (the text before the first `<tool_call>` or `<function=`). A value is the
text between `<parameter=KEY>` and `</parameter>` (or the next `<parameter=`, or the end of
the function) less one newline at each end, typed by the tool's schema in the request
(param_values.qwen3_value). As in vLLM, `<tool_call>` may be missing, and a function still
open when the text ends is a call with the values written so far. While streaming, a string
value goes out as it is written; other values once they end.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ExtractedToolCallInformation
from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    StreamSnapshot,
    ToolParser,
    ToolParserManager,
    no_tool_calls,
)
from jaxserve.entrypoints.openai.tool_parsers.param_values import (
    arguments,
    arguments_prefix,
    qwen3_properties,
    qwen3_stays_string,
    qwen3_type,
    qwen3_value,
)
from jaxserve.entrypoints.openai.tool_parsers.utils import (
    find_first,
    hold_back_markers,
    streamed_content_before_any,
)


class Markers(NamedTuple):
    """A format of named-parameter calls: a function's name is the text between `function`
    and `name_end`, a parameter's key between `parameter` and `name_end`."""

    call_start: str
    function: str
    parameter: str
    name_end: str
    function_end: str
    parameter_end: str
    call_end: str
    trim: bool = True  # a value's text less one newline at each end (not DSML's)

    @property
    def body_ends(self) -> tuple[str, ...]:
        """What ends a function's body."""
        return (self.function_end, self.function, self.call_end)

    @property
    def value_ends(self) -> tuple[str, ...]:
        """What ends a parameter's value."""
        return (self.parameter_end, self.parameter, *self.body_ends)


QWEN3 = Markers(
    "<tool_call>", "<function=", "<parameter=", ">", "</function>", "</parameter>", "</tool_call>"
)


class Function(NamedTuple):
    at: int  # where its `<function=` is
    name: str
    params: list[tuple[str, str]]  # (key, raw value) of the finished parameters
    open_param: tuple[str, str] | None  # (key, certain raw text) of an unfinished one
    closed: bool  # its body has ended


def _trim(raw: str) -> str:
    """A value's text less one newline at each end."""
    return raw.removeprefix("\n").removesuffix("\n")


def scan_functions(text: str, start: int, final: bool, m: Markers = QWEN3) -> list[Function]:
    """The functions from `text[start:]` whose name is certain. Unless `final`, the text is
    still growing: a marker may be cut at its end, and an open function or value may go on
    (a function is certain only where its name's end is)."""
    functions: list[Function] = []
    pos = text.find(m.function, start)
    while pos >= 0:
        name_at = pos + len(m.function)
        gt = text.find(m.name_end, name_at)
        if gt <= name_at or "<" in text[name_at:gt]:  # no name (yet)
            break
        open_at = gt + len(m.name_end)
        body_end = find_first(text, m.body_ends, open_at)
        closed = body_end >= 0 or final
        body = text[open_at : body_end if body_end >= 0 else len(text)]
        if not closed:
            body = hold_back_markers(body, m.body_ends)
        params, open_param = _scan_params(body, closed, m)
        functions.append(Function(pos, text[name_at:gt], params, open_param, closed))
        if body_end < 0:
            break
        pos = text.find(m.function, body_end)
    return functions


def _scan_params(body: str, closed: bool, m: Markers) -> tuple[list[tuple[str, str]], Any]:
    """(finished (key, raw value) pairs, the open one or None) of a function's body."""
    params: list[tuple[str, str]] = []
    pos = body.find(m.parameter)
    while pos >= 0:
        key_at = pos + len(m.parameter)
        gt = body.find(m.name_end, key_at)
        if gt < 0:
            break
        value_at = gt + len(m.name_end)
        end = find_first(body, m.value_ends, value_at)
        if end < 0:
            raw = body[value_at:]
            if closed:
                params.append((body[key_at:gt], _trim(raw) if m.trim else raw))
                break
            raw = hold_back_markers(raw, m.value_ends)
            return params, (body[key_at:gt], raw.removeprefix("\n") if m.trim else raw)
        raw = body[value_at:end]
        params.append((body[key_at:gt], _trim(raw) if m.trim else raw))
        pos = body.find(m.parameter, end)
    return params, None


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    loose_types = True  # types the parser does not know are parsed as literals too
    markers = QWEN3

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep special tokens when the tokenizer marks the call markers as such."""
        start = self.markers.call_start
        if request.tools and request.tool_choice != "none" and self.marks_special(start):
            request.skip_special_tokens = False
        return request

    def param(self, props: dict[str, Any], marked: str) -> tuple[str, str]:
        """(name, type) of a parameter whose marker holds `marked` where its name goes."""
        return marked, qwen3_type(props, marked, self.loose_types)

    def typed(self, raw: str, kind: str) -> Any:
        """A finished value's text as its type."""
        return qwen3_value(raw, kind)

    def stays_string(self, partial: str, kind: str) -> bool:
        """Whether an open value starting `partial` streams as a string as it is written."""
        return qwen3_stays_string(partial, kind)

    def _values(
        self, function: Function, request: ChatCompletionRequest | None
    ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
        """(the tool's properties, the function's finished values typed by them)."""
        props = qwen3_properties(request, function.name)
        values = []
        for marked, raw in function.params:
            key, kind = self.param(props, marked)
            values.append((key, self.typed(raw, kind)))
        return props, values

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        m = self.markers
        start = find_first(model_output, (m.call_start, m.function))
        if start < 0:
            return no_tool_calls(model_output)
        functions = scan_functions(model_output, start, final=True, m=m)
        if not functions:
            return no_tool_calls(model_output)
        content = model_output[:start]
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[
                self.make_tool_call(f.name, arguments(self._values(f, request)[1]))
                for f in functions
            ],
            content=content if content.strip() else None,
        )

    def stream_snapshot(self, text: str) -> StreamSnapshot:
        m = self.markers
        content, start = streamed_content_before_any(text, (m.call_start, m.function))
        if start < 0:
            return content, []
        calls = []
        memo = self.scan_memo(text)
        for function in scan_functions(text, start, final=False, m=m):
            if function.closed:  # typed once
                key = ("function", function.at)
                if key not in memo.entries:
                    memo.entries[key] = arguments(self._values(function, self.request)[1])
                calls.append((function.name, memo.entries[key]))
                continue
            props, values = self._values(function, self.request)
            open_string = None
            if function.open_param is not None:
                key, kind = self.param(props, function.open_param[0])
                partial = function.open_param[1]
                if self.markers.trim:  # a last newline is not the value's
                    partial = partial.removesuffix("\n")
                if self.stays_string(partial, kind):
                    open_string = (key, partial)
            calls.append((function.name, arguments_prefix(values, open_string)))
        return content, calls
