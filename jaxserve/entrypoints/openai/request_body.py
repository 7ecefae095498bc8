"""Reading a request's JSON body: what every POST route does before its handler sees a field.

- At most `max_bytes` bytes (--max-request-body-bytes): a larger Content-Length is refused
  before reading, and a body sent without one (chunked) is refused as soon as the bytes read
  pass the limit, so a huge body is never held in memory (413).
- Its structure bounded before it is decoded (json_limits.py: depth, arrays and objects,
  values per field, integers within the engine core's 64 bits), free-form fields
  (kv_transfer_params, chat_template_kwargs, tools, response_format, messages, prompt, ...)
  like the typed ones: a ValueError naming the field (a 400), not a 500, and never a Python
  object built for a body that is refused. A large body is scanned as it is read (each
  MiB), so one past a limit is refused before the rest of it is read.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from jaxserve.entrypoints.openai.json_limits import BodyLimits
from jaxserve.entrypoints.openai.protocol import decode_request

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024  # long prompts (1M token ids) fit
FEED_BYTES = 1 << 20  # read_body's check: after each MiB read


class RequestTooLarge(ValueError):
    """A body over --max-request-body-bytes (HTTP 413)."""


async def read_body(request: Request, max_bytes: int, check=None) -> bytes:
    """The body, read chunk by chunk; RequestTooLarge once it passes max_bytes. check: an
    async function of the bytes read so far (a bytearray), awaited each time FEED_BYTES more
    have come, that raises to refuse the body before the rest is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body, checked = bytearray(), 0
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:
            raise _too_large(len(body) + len(chunk), max_bytes, at_least=True)
        body += chunk
        if check is not None and len(body) - checked >= FEED_BYTES:
            checked = len(body)
            await check(body)
    return bytes(body)


def _too_large(size: int, limit: int, at_least: bool = False) -> RequestTooLarge:
    return RequestTooLarge(
        f"the request body has {'more than ' if at_least else ''}{size - at_least} bytes, "
        f"over the server's limit of {limit} (--max-request-body-bytes)"
    )


def decode_json(body: bytes, cls: type, limits: BodyLimits | None = None) -> Any:
    """body -> an instance of the msgspec Struct `cls` (unknown fields logged), once its
    bytes are within json_limits' limits (`limits`: what scanned it as it was read)."""
    (limits or BodyLimits()).finish(body)
    return decode_request(body, cls)
