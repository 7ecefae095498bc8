"""Reading a request's JSON body: what every POST route does before its handler sees a field.

- Content-Type must be application/json (a 400 naming the one sent, as vLLM answers): a
  cross-site HTML form can only send text/plain, urlencoded or multipart bodies without a CORS
  preflight, so this keeps any web page's "simple" POST away from the model.
- At most `max_bytes` bytes (--max-request-body-bytes): a larger Content-Length is refused
  before reading, and a body sent without one (chunked) is refused as soon as the bytes read
  pass the limit, so a huge body is never held in memory (413).
- Nested at most MAX_JSON_DEPTH levels, and every integer inside fits 64 bits (the engine
  core's msgpack wire: [-2**63, 2**64 - 1]); free-form fields (kv_transfer_params,
  chat_template_kwargs, tools, response_format, messages, prompt, ...) are checked like the
  typed ones. A violation is a ValueError naming the field (a 400), not a 500.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from jaxserve.entrypoints.openai.protocol import decode_request

MAX_JSON_DEPTH = 64  # levels of arrays and objects, the body itself being level 1
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024  # long prompts (1M token ids) fit
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


class RequestTooLarge(ValueError):
    """A body over --max-request-body-bytes (HTTP 413)."""


def check_content_type(request: Request) -> None:
    """ValueError unless the body is declared application/json (parameters such as charset
    may follow)."""
    given = request.headers.get("content-type")
    media_type = (given or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise ValueError(
            "Unsupported Media Type: only 'application/json' is allowed, got "
            + (repr(given) if given is not None else "no Content-Type")
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, read chunk by chunk; RequestTooLarge once it passes max_bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> RequestTooLarge:
    return RequestTooLarge(
        f"the request body has {'more than ' if at_least else ''}{size - at_least} bytes, "
        f"over the server's limit of {limit} (--max-request-body-bytes)"
    )


def decode_json(body: bytes, cls: type) -> Any:
    """body -> an instance of the msgspec Struct `cls`, checked by check_json_value."""
    try:
        value = decode_request(body, cls)  # unknown fields logged
    except RecursionError:
        raise ValueError(
            f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    for name in getattr(cls, "__struct_fields__", ()):
        check_json_value(getattr(value, name), name)
    return value


def check_json_value(value: Any, name: str, depth: int = 1) -> None:
    """ValueError naming `name` (and the path below it) if `value`, a decoded top-level field
    at depth `depth` + 1 of the body, nests deeper than MAX_JSON_DEPTH or holds an integer
    outside the 64-bit range. Iterative (no recursion however deep the value)."""
    stack: list[tuple[Any, int, str]] = [(value, depth + 1, name)]
    while stack:
        item, level, path = stack.pop()
        if isinstance(item, int):
            if not _INT_MIN <= item <= _INT_MAX:
                raise ValueError(
                    f"{path}: the integer {_short(item)} is outside the 64-bit range "
                    f"[-2**63, 2**64 - 1]"
                )
            continue
        if not isinstance(item, dict | list | tuple):
            continue  # str, float, bool, None, typed sub-structs (msgspec checked them)
        if level > MAX_JSON_DEPTH:
            raise ValueError(f"{path}: the JSON is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, dict):
            children = ((f"{path}.{k}", v) for k, v in item.items())
        elif set(map(type, item)) <= {int}:  # e.g. token ids: checked at C speed
            if item and (min(item) < _INT_MIN or max(item) > _INT_MAX):
                i = next(i for i, v in enumerate(item) if not _INT_MIN <= v <= _INT_MAX)
                stack.append((item[i], level + 1, f"{path}[{i}]"))
            continue
        else:
            children = ((f"{path}[{i}]", v) for i, v in enumerate(item))
        for child_path, child in children:
            if isinstance(child, dict | list | tuple | int):
                stack.append((child, level + 1, child_path))


def _short(n: int) -> str:
    return str(n) if abs(n) < 2**128 else f"of {n.bit_length()} bits"
