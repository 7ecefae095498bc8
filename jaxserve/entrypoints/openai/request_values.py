"""Request values vLLM's OpenAI server accepts beyond their strict JSON type, and its wording
for the ones it refuses, so a vLLM client's request means the same here.

- `lax_bools`: a boolean field sent as "true" / "no" / 1 / 0.0 (vLLM's pydantic models read
  booleans in lax mode; clients and tests send `"logprobs": "true"`). Only the top-level
  boolean fields of a request: every other field keeps msgspec's strict type.
- `logprobs_count`: -1 for logprobs, top_logprobs or prompt_logprobs means every token of
  the vocabulary (then bounded by --max-logprobs, as in vLLM).
- `logit_bias_ids`: logit_bias keys as token ids, every key that is not one named at once,
  biases clamped to [-100, 100] as vLLM clamps them.
- `out_of_int64`: the message for an integer outside a 64-bit field's range, with the bound
  it broke by its validation name (less_than_equal / greater_than_equal), which vLLM's
  clients match on.
"""

from __future__ import annotations

import functools
import types
import typing

import msgspec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# What pydantic's lax mode reads as a boolean (strings case-insensitively; 1.0 is 1).
_BOOL_WORDS = {
    **dict.fromkeys(("true", "t", "yes", "y", "on", "1"), True),
    **dict.fromkeys(("false", "f", "no", "n", "off", "0"), False),
}
_LONGEST_BOOL = 8  # bytes of the longest JSON value that can read as a boolean ("false" + ")


@functools.cache
def _bool_fields(cls: type[msgspec.Struct]) -> frozenset[str]:
    """The fields of `cls` typed bool or bool | None."""
    names = set()
    for field in msgspec.structs.fields(cls):
        kinds = set(typing.get_args(field.type)) or {field.type}
        if bool in kinds and kinds <= {bool, types.NoneType}:
            names.add(field.encode_name)
    return frozenset(names)


def _as_bool(raw: bytes) -> bool | None:
    """The boolean a JSON value reads as in lax mode, None if it does not."""
    if len(raw) > _LONGEST_BOOL:
        return None
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(value, str):
        return _BOOL_WORDS.get(value.lower())
    if isinstance(value, int | float) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return None


def lax_bools(body: bytes, cls: type[msgspec.Struct]) -> bytes | None:
    """`body` (a JSON object) with its top-level boolean fields that hold "true", "no", 1,
    0.0 ... rewritten as JSON booleans; None when there is nothing to rewrite (so the strict
    decode's error stands)."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    changed = False
    for name in _bool_fields(cls) & fields.keys():
        value = _as_bool(bytes(fields[name]))
        if value is not None:
            fields[name] = msgspec.Raw(b"true" if value else b"false")
            changed = True
    return msgspec.json.encode(fields) if changed else None


def logprobs_count(name: str, value: int | None, vocab_size: int) -> int | None:
    """How many logprobs per position `name` asks for: -1 is the whole vocabulary; other
    negative values are refused (ValueError naming the field)."""
    if value is None or value >= 0:
        return value
    if value == -1:
        return vocab_size
    raise ValueError(f"{name} must be a non-negative integer or -1 (every token), got {value}")


def logit_bias_ids(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """{token id: bias in [-100, 100]} (vLLM clamps out-of-range biases); ValueError naming
    every key that is not an integer token id."""
    if not logit_bias:
        return None
    bad = [key for key in logit_bias if not _is_integer(key)]
    if bad:
        raise ValueError(f"logit_bias keys must be integer token ids; these are not: {bad!r}")
    return {int(k): min(100.0, max(-100.0, float(v))) for k, v in logit_bias.items()}


def _is_integer(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


def out_of_int64(field: str, value: int) -> str | None:
    """The refusal of `value` for a 64-bit signed field, None when it fits."""
    if value > INT64_MAX:
        return f"{field} must be at most {INT64_MAX} (less_than_equal), got {value}"
    if value < INT64_MIN:
        return f"{field} must be at least {INT64_MIN} (greater_than_equal), got {value}"
    return None
