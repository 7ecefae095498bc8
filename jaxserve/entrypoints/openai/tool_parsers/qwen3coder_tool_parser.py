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

CALL_START, FUNCTION, PARAMETER = "<tool_call>", "<function=", "<parameter="
FUNCTION_END, PARAMETER_END, CALL_END = "</function>", "</parameter>", "</tool_call>"
# what ends a function's body, and a parameter's value
_BODY_ENDS = (FUNCTION_END, FUNCTION, CALL_END)
_VALUE_ENDS = (PARAMETER_END, PARAMETER, *_BODY_ENDS)


class Function(NamedTuple):
    at: int  # where its `<function=` is
    name: str
    params: list[tuple[str, str]]  # (key, raw value) of the finished parameters
    open_param: tuple[str, str] | None  # (key, certain raw text) of an unfinished one
    closed: bool  # its body has ended


def _trim(raw: str) -> str:
    """A value's text less one newline at each end."""
    return raw.removeprefix("\n").removesuffix("\n")


def scan_functions(text: str, start: int, final: bool) -> list[Function]:
    """The functions from `text[start:]` whose name is certain. Unless `final`, the text is
    still growing: a marker may be cut at its end, and an open function or value may go on
    (a function is certain only where its name's `>` is)."""
    functions: list[Function] = []
    pos = text.find(FUNCTION, start)
    while pos >= 0:
        name_at = pos + len(FUNCTION)
        gt = text.find(">", name_at)
        if gt <= name_at or "<" in text[name_at:gt]:  # no name (yet)
            break
        body_end = find_first(text, _BODY_ENDS, gt + 1)
        closed = body_end >= 0 or final
        body = text[gt + 1 : body_end if body_end >= 0 else len(text)]
        if not closed:
            body = hold_back_markers(body, _BODY_ENDS)
        params, open_param = _scan_params(body, closed)
        functions.append(Function(pos, text[name_at:gt], params, open_param, closed))
        if body_end < 0:
            break
        pos = text.find(FUNCTION, body_end)
    return functions


def _scan_params(body: str, closed: bool) -> tuple[list[tuple[str, str]], Any]:
    """(finished (key, raw value) pairs, the open one or None) of a function's body."""
    params: list[tuple[str, str]] = []
    pos = body.find(PARAMETER)
    while pos >= 0:
        key_at = pos + len(PARAMETER)
        gt = body.find(">", key_at)
        if gt < 0:
            break
        end = find_first(body, _VALUE_ENDS, gt + 1)
        if end < 0:
            raw = body[gt + 1 :]
            if closed:
                params.append((body[key_at:gt], _trim(raw)))
                break
            raw = hold_back_markers(raw, _VALUE_ENDS).removeprefix("\n")
            return params, (body[key_at:gt], raw)
        params.append((body[key_at:gt], _trim(body[gt + 1 : end])))
        pos = body.find(PARAMETER, end)
    return params, None


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    loose_types = True  # types the parser does not know are parsed as literals too

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep special tokens when the tokenizer marks the call markers as such."""
        if request.tools and request.tool_choice != "none" and self.marks_special(CALL_START):
            request.skip_special_tokens = False
        return request

    def _values(
        self, function: Function, request: ChatCompletionRequest | None
    ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
        """(the tool's properties, the function's finished values typed by them)."""
        props = qwen3_properties(request, function.name)
        kinds = [qwen3_type(props, k, self.loose_types) for k, _ in function.params]
        return props, [
            (k, qwen3_value(v, kind)) for (k, v), kind in zip(function.params, kinds, strict=True)
        ]

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> ExtractedToolCallInformation:
        start = find_first(model_output, (CALL_START, FUNCTION))
        if start < 0:
            return no_tool_calls(model_output)
        functions = scan_functions(model_output, start, final=True)
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
        content, start = streamed_content_before_any(text, (CALL_START, FUNCTION))
        if start < 0:
            return content, []
        calls = []
        memo = self.scan_memo(text)
        for function in scan_functions(text, start, final=False):
            if function.closed:  # typed once
                key = ("function", function.at)
                if key not in memo.entries:
                    memo.entries[key] = arguments(self._values(function, self.request)[1])
                calls.append((function.name, memo.entries[key]))
                continue
            props, values = self._values(function, self.request)
            open_string = None
            if function.open_param is not None:
                key, raw = function.open_param
                partial = raw.removesuffix("\n")  # a last newline is not the value's
                if qwen3_stays_string(partial, qwen3_type(props, key, self.loose_types)):
                    open_string = (key, partial)
            calls.append((function.name, arguments_prefix(values, open_string)))
        return content, calls
