"""Arguments written as named text values (the XML-like formats of `glm45`, `qwen3_coder` and
`qwen3_xml`): each value is text, typed by the tool's JSON schema in the request, and the
arguments are the JSON object of the typed values in the order written (a repeated name keeps
its first place and its last value, as a dict does).

While a call streams, `arguments_prefix` gives the certain start of that object: the finished
values, then the text so far of an open value that stays a string whatever follows.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.tool_parsers.utils import dumps

STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_FLOAT_PREFIXES = ("num", "float")
_BOOL_TYPES = ("boolean", "bool", "binary")
_CONTAINER_TYPES = ("object", "array", "arr", "sequence")


def tool_parameters(request: ChatCompletionRequest | None, name: str) -> dict[str, Any]:
    """The parameters schema of the request's function tool `name`; {} if there is none."""
    for tool in (request.tools if request is not None else None) or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            return params if isinstance(params, dict) else {}
    return {}


def _jsonable(value: Any, raw: str) -> Any:
    """`value` if it serializes as strict JSON (no NaN, sets, bytes...), else `raw`."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return raw
    return value


def _literal(raw: str) -> Any:
    """`raw` as JSON, else as a Python literal, else `raw` itself."""
    try:
        return _jsonable(json.loads(raw), raw)
    except (ValueError, RecursionError):
        pass
    try:
        return _jsonable(ast.literal_eval(raw), raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw


# ---------------------------------------------------------------------- qwen3_coder / qwen3_xml
def qwen3_type(properties: dict[str, Any], key: str, loose: bool) -> str:
    """A parameter's type as Qwen3-Coder's parsers read it: "string" for a name the schema
    does not have or a property without a type; with `loose` (qwen3_coder) any other type as
    written, else (qwen3_xml) only the types it knows, the others "string"."""
    prop = properties.get(key)
    if not isinstance(prop, dict) or "type" not in prop:
        return "string"
    kind = str(prop["type"]).strip().lower()
    known = (
        kind in STRING_TYPES
        or kind.startswith(_INT_PREFIXES + _FLOAT_PREFIXES + ("dict", "list"))
        or kind in _BOOL_TYPES + _CONTAINER_TYPES
    )
    return kind if loose or known else "string"


def qwen3_properties(request: ChatCompletionRequest | None, name: str) -> dict[str, Any]:
    """The properties of tool `name` (its parameters themselves when they have none)."""
    params = tool_parameters(request, name)
    props = params.get("properties", params)
    return props if isinstance(props, dict) else {}


def qwen3_value(raw: str, kind: str) -> Any:
    """A parameter's text as its type: "null" (any case) is null; integers and numbers (an
    integral number as an integer) and booleans ("true", any case; anything else is false)
    parsed; objects, arrays and other types as JSON or a Python literal; a string, or text
    that does not parse as its type, as written."""
    if raw.lower() == "null":
        return None
    if kind in STRING_TYPES:
        return raw
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(_FLOAT_PREFIXES):
        try:
            number = float(raw)
            return int(number) if number.is_integer() else _jsonable(number, raw)
        except (ValueError, OverflowError):
            return raw
    if kind in _BOOL_TYPES:
        return raw.lower() == "true"
    return _literal(raw)


def qwen3_stays_string(partial: str, kind: str) -> bool:
    """Whether a value whose text starts with `partial` is that text as a string whatever
    follows (not while it may still be "null")."""
    return kind in STRING_TYPES and not "null".startswith(partial.lower())


# ---------------------------------------------------------------------- deepseek_v32
def json_value(raw: str) -> Any:
    """`raw` as strict JSON, else `raw` itself (DSML's values marked string="false")."""
    try:
        return _jsonable(json.loads(raw), raw)
    except (ValueError, RecursionError):
        return raw


# ---------------------------------------------------------------------- glm45
def glm_is_string(request: ChatCompletionRequest | None, name: str, key: str) -> bool:
    """Whether the schema of tool `name` types argument `key` as a string."""
    props = tool_parameters(request, name).get("properties")
    prop = props.get(key) if isinstance(props, dict) else None
    return isinstance(prop, dict) and prop.get("type") == "string"


def glm_value(raw: str, is_string: bool) -> Any:
    """An argument's (stripped) text: as written for a string, else as JSON or a Python
    literal, else as written."""
    return raw if is_string else _literal(raw)


# ---------------------------------------------------------------------- the arguments
def arguments(values: list[tuple[str, Any]]) -> str:
    """The arguments JSON of the named values, in order."""
    return dumps(dict(values))


def arguments_prefix(values: list[tuple[str, Any]], open_string: tuple[str, str] | None) -> str:
    """The certain start of `arguments` while a call streams: the finished `values`, then
    `open_string` (a name and the certain start of its string value) if given. Stops before
    a repeated name (its value would land at the name's first place)."""
    seen: set[str] = set()
    parts = []
    for key, value in values:
        if key in seen:
            return "{" + ", ".join(parts) if parts else ""
        seen.add(key)
        parts.append(f"{dumps(key)}: {dumps(value)}")
    if open_string is not None and open_string[0] not in seen:
        key, text = open_string
        parts.append(f"{dumps(key)}: {dumps(text)[:-1]}")
    return "{" + ", ".join(parts) if parts else ""
