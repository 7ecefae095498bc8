"""A flag whose value is a JSON object: given as a dict (Python) or its JSON text (the CLI)."""

from __future__ import annotations

import json


def json_object(value: dict | str | None, name: str) -> dict:
    """A flag's JSON object (a dict, its JSON text, or None: {}); ValueError names `name` and
    the bad value."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} {value!r} is not JSON: {e}") from None
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value
