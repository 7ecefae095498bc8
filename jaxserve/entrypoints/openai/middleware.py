"""The app's ASGI middleware: CORS (only when --allowed-origins is given) outside the API-key
check, so a browser's preflight is answered before any key is asked for."""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_json = msgspec.json.Encoder()


class APIKeyMiddleware:
    """Bearer-token check on /v1 paths (pure ASGI, so streaming passes through untouched);
    Anthropic's Messages API (/v1/messages...) takes the key as its clients send it too, in
    an x-api-key header, and answers a 401 in Anthropic's error shape."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    def authorized(self, scope: Scope, anthropic: bool = False) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):  # constant time
            return True
        return anthropic and hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["path"].startswith("/v1")
        anthropic = guarded and scope["path"].startswith("/v1/messages")
        if guarded and not self.authorized(scope, anthropic):
            message = "Unauthorized: a valid API key is required"
            body = _json.encode(ErrorResponse(ErrorInfo(message, "AuthenticationError", 401)))
            if anthropic:
                error = {"type": "authentication_error", "message": message}
                body = _json.encode({"type": "error", "error": error})
            await Response(body, 401, media_type="application/json")(scope, receive, send)
            return
        await self.app(scope, receive, send)


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


def app_middleware(api_key: str | None, cors: dict[str, Any] | None) -> list[Middleware]:
    """Outermost first: CORS, then the API key."""
    keyed = [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    return cors_middleware(cors) + keyed
