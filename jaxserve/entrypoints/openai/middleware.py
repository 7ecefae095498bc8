"""The app's ASGI middleware, one rule in one place for every route:

- CORS (only when --allowed-origins is given), outermost, so a browser's preflight is answered
  before any key is asked for.
- With --root-path (a proxy's path prefix), every route answers with and without it, as
  vLLM's do: the prefix is stripped before routing and before the rules below.
- With an API key (--api-key, which may give several, JAXSERVE_API_KEY or VLLM_API_KEY),
  every request needs one except PUBLIC's:
  the probes a load balancer or Kubernetes calls without credentials. That covers routes
  added later and paths that do not exist (a keyless request to one is a 401, not a 404).
  `Authorization: Bearer KEY`, the scheme in any case (as vLLM reads it); Anthropic's
  Messages API (/v1/messages...) also takes the key as its clients send it, in x-api-key.
- Every POST but PUBLIC's declares its body `Content-Type: application/json` (parameters such
  as charset may follow), with a body or without: a web page can send a cross-site POST
  without a CORS preflight only as text/plain, urlencoded or multipart (GET and HEAD change
  nothing; any other method needs a preflight anyway), so no page reaches the model, /sleep
  or /collective_rpc from a developer's browser.

Refusals are each API's error JSON: OpenAI's, Anthropic's on /v1/messages.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import msgspec
from starlette._utils import get_route_path
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from jaxserve.entrypoints.openai.protocol_anthropic import ERROR_TYPES

# path -> the methods served there without the API key and with any body: the probes
# (probes.py; vLLM's /ping takes POST too, as SageMaker sends it), /metrics and /version
PUBLIC = {
    "/health": ("GET", "HEAD"),
    "/ping": ("GET", "HEAD", "POST"),
    "/ready": ("GET", "HEAD"),
    "/metrics": ("GET", "HEAD"),
    "/version": ("GET", "HEAD"),
}
ANTHROPIC_PREFIX = "/v1/messages"
DRAIN_BYTES = 1 << 20  # a refused request's unread body the server still reads, to keep it

_json = msgspec.json.Encoder()


def _digest(value: bytes) -> bytes:
    """Compared in constant time, whatever the lengths (a digest's is fixed)."""
    return hashlib.sha256(value).digest()


def content_type_error(given: bytes | None) -> str | None:
    """What is wrong with a POST's Content-Type header, or None if it declares JSON."""
    media_type = (given or b"").split(b";", 1)[0].strip().lower()
    if media_type == b"application/json":
        return None
    shown = repr(given.decode("latin-1")) if given is not None else "no Content-Type"
    return f"Unsupported Media Type: only 'application/json' is allowed, got {shown}"


class GateMiddleware:
    """The API key (when one is set) and the JSON Content-Type of POSTs, on every path but
    PUBLIC's (pure ASGI, so streaming passes through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str] | None, root_path: str = ""):
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self.keys = [_digest(key.encode()) for key in keys if key] or None
        self.root_path = root_path.rstrip("/")

    def authorized(self, headers: dict[bytes, bytes], anthropic: bool) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() == b"bearer" and self._known(token.strip()):
            return True
        given = headers.get(b"x-api-key")
        return anthropic and given is not None and self._known(given)

    def _known(self, given: bytes) -> bool:
        """One of the keys (every one compared, so the time tells nothing of which)."""
        digest = _digest(given)
        return sum(hmac.compare_digest(digest, key) for key in self.keys) > 0

    def refusal(
        self, scope: Scope, headers: dict[bytes, bytes], anthropic: bool
    ) -> tuple[int, str, str] | None:
        """(status, message, OpenAI error type) of a request refused here, or None."""
        if self.keys is not None and not self.authorized(headers, anthropic):
            return 401, "Unauthorized: a valid API key is required", "AuthenticationError"
        if scope["method"] == "POST":
            error = content_type_error(headers.get(b"content-type"))
            if error is not None:
                return 400, error, "BadRequestError"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.root_path:  # starlette routes scope["path"] less this prefix, when it has it
            scope = dict(scope, root_path=self.root_path)
        path = get_route_path(scope)
        headers = dict(scope["headers"])
        unread = UnreadBody(headers)
        receive, send = unread.receive(receive), unread.send(send)
        if scope["method"] in PUBLIC.get(path, ()):
            await self.app(scope, receive, send)
            return
        anthropic = path.startswith(ANTHROPIC_PREFIX)
        refused = self.refusal(scope, headers, anthropic)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message, kind = refused
        body = _json.encode(ErrorResponse(ErrorInfo(message, kind, status)))
        if anthropic:
            error = {"type": ERROR_TYPES[status], "message": message}
            body = _json.encode({"type": "error", "error": error})
        await Response(body, status, media_type="application/json")(scope, receive, send)


class UnreadBody:
    """A response sent before its request's body is read (a refusal: no key, a body too
    large or past a json_limits bound) closes the connection when more than DRAIN_BYTES of
    the body are still to come. Keeping it open, the server would read and parse all of it
    (up to --max-request-body-bytes) only to discard it: 6 ms of the API process for each
    11 MB body sent without a key, 0.4-0.8 ms when closed. Clients still read the answer
    (httpx, requests and curl were seen to)."""

    def __init__(self, headers: dict[bytes, bytes]):
        length = headers.get(b"content-length", b"").strip()
        self.left = int(length) if length.isdigit() else None  # None: chunked, or no body
        self.chunked = b"transfer-encoding" in headers
        self.done = False

    def receive(self, receive: Receive) -> Receive:
        async def counting() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                if self.left is not None:
                    self.left -= len(message.get("body", b""))
                self.done = not message.get("more_body", False)
            return message

        return counting

    def send(self, send: Send) -> Send:
        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.large_rest():
                headers = [*message.get("headers", ()), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        return closing

    def large_rest(self) -> bool:
        if self.done:
            return False
        return self.chunked if self.left is None else self.left > DRAIN_BYTES


def cors_middleware(cors: dict[str, Any] | None) -> list[Middleware]:
    """Starlette's CORSMiddleware over `cors` = {"allow_origins", "allow_methods",
    "allow_headers", "allow_credentials"} (vLLM's --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials); none without allowed origins. Unlike vLLM, whose
    origins default to "*", nothing is allowed unless asked for: a "*" lets any web page's
    JSON POST through the browser's preflight (and, with a key in the page, to the model)."""
    if not cors or not cors.get("allow_origins"):
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(cors["allow_origins"]),
            allow_methods=list(cors.get("allow_methods") or ["*"]),
            allow_headers=list(cors.get("allow_headers") or ["*"]),
            allow_credentials=bool(cors.get("allow_credentials")),
        )
    ]


def app_middleware(
    api_key: str | Sequence[str] | None, cors: dict[str, Any] | None, root_path: str = ""
) -> list[Middleware]:
    """Outermost first: CORS, then the gate (installed with or without a key: the
    Content-Type rule holds either way; it also applies --root-path)."""
    gate = Middleware(GateMiddleware, api_key=api_key or None, root_path=root_path)
    return [*cors_middleware(cors), gate]
