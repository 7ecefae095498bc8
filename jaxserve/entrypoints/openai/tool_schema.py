"""The JSON schemas that enforce a chat request's tool_choice as structured output.

A named function's arguments follow its `parameters` schema as it is. tool_choice "required"
is a JSON array of `{"name", "parameters"}` calls, so each tool's parameters sit nested inside
the array's schema; the local references in them (`"$ref": "#/$defs/Address"`, what pydantic's
`model_json_schema` writes, or `"#"` for a recursive type) were written against the
parameters' own root, and nested they would point at the array's root instead (llguidance:
"Pointer '/$defs/Address' does not exist"). `required_calls_schema` rewrites each local
reference to where that tool's parameters now sit, so every tool keeps its own `$defs` (or
`definitions`) in place: two tools may each define an `Address` of their own, and nothing is
merged. (vLLM merges the tools' `$defs` into the array's root and refuses two tools whose
definitions of one name differ.)
"""

from __future__ import annotations

from typing import Any

# Keywords whose values are data, not schemas: a "$ref" key inside them is left alone.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: every value is walked as a schema, whatever its
# name (a property may be called "default" or "enum").
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def tool_parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; none (or empty): an object of any properties."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def required_calls_schema(functions: dict[str, dict[str, Any]], *, parallel: bool) -> dict:
    """The schema of tool_choice "required": an array of one or more calls (at most one
    unless `parallel`), each `{"name": <a tool's name>, "parameters": <its arguments>}`.
    functions: the tools' `function` objects by name, in the request's order."""
    one = len(functions) == 1
    calls = []
    for i, (name, function) in enumerate(functions.items()):
        at = "/items" if one else f"/items/anyOf/{i}"
        parameters = relocate_refs(tool_parameters(function), f"{at}/properties/parameters")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if one else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1  # one call: nothing to cut afterwards
    return schema


def relocate_refs(schema: Any, pointer: str) -> Any:
    """A copy of `schema` for nesting at JSON pointer `pointer` of a bigger schema: each
    local reference ("#" or "#/...") prefixed with it, so it still names the same place
    (anchors, "#name", and references to other documents stay as they are). The walk is as
    deep as the request's JSON, which json_limits bounds."""
    if isinstance(schema, list):
        return [relocate_refs(v, pointer) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: relocate_refs(v, pointer) for name, v in value.items()}
        else:
            out[key] = relocate_refs(value, pointer)
    return out
