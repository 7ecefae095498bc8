"""`jaxserve proxy`: disaggregated prefill/decode in front of jaxserve servers (vLLM's P/D proxy).

Each /v1/completions or /v1/chat/completions request first goes to a prefill instance (round
robin) as a one-token, non-streamed request with kv_transfer_params {"do_remote_decode": true,
...}: that engine computes the prompt's KV and its KV connector holds it for a decoder. The
kv_transfer_params of its response then go with the original request to a decode instance
(round robin), which loads that KV instead of computing it; the decoder's answer (JSON or an
SSE stream, any status) goes back as it is. A failed prefill is logged, and the decoder then
computes the prompt itself. GET /v1/models and /health go to the first decode instance.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.entrypoints.openai.api_common import run_until_disconnected

logger = logging.getLogger("jaxserve.disagg_proxy")

# What a prefill instance is sent: compute the prompt, keep its KV for a remote decoder.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
FORWARDED_HEADERS = ("authorization", "x-request-id")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: one token, not streamed, its KV kept for a decoder."""
    body = {k: v for k, v in body.items() if k != "stream_options"}
    body.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def _error(message: str, status: int, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class DisaggProxy:
    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        """transport: httpx's (default: the network; tests pass a mock)."""
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        self.decode_urls = [url.rstrip("/") for url in decode_urls]
        self.prefills = itertools.cycle([url.rstrip("/") for url in prefill_urls])
        self.decodes = itertools.cycle(self.decode_urls)
        self.transport = transport
        self.client: httpx.AsyncClient | None = None  # opened by the app's lifespan

    async def prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """The prefill instance's kv_transfer_params; None (logged) if it failed."""
        url = next(self.prefills) + path
        try:
            r = await self.client.post(url, json=prefill_body(body), headers=headers)
            if r.status_code == 200:
                return r.json().get("kv_transfer_params")
            problem = f"status {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as e:
            problem = repr(e)
        logger.warning("prefill at %s failed (%s); the decoder computes the prompt", url, problem)
        return None

    async def generate(self, request: Request) -> Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, got {type(body).__name__}")
        except ValueError as e:
            return _error(f"invalid request body: {e}", 400, "BadRequestError")
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}

        async def run() -> Response:
            kv = await self.prefill(request.url.path, body, headers)
            decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            if kv:
                decode["kv_transfer_params"] = kv
            url = next(self.decodes) + request.url.path
            return await self.forward("POST", url, json=decode, headers=headers)

        response = await run_until_disconnected(request, run())
        return Response(status_code=499) if response is None else response  # 499: nobody reads it

    async def passthrough(self, request: Request) -> Response:
        """GET /v1/models, /health: the first decode instance's answer."""
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        return await self.forward("GET", self.decode_urls[0] + request.url.path, headers=headers)

    async def forward(self, method: str, url: str, **kwargs: Any) -> Response:
        """The upstream answer as it is (status, content type, body), streamed through; the
        upstream request is closed (so aborted) if the client goes away."""
        try:
            upstream = await self.client.send(
                self.client.build_request(method, url, **kwargs), stream=True
            )
        except httpx.HTTPError as e:
            return _error(f"{url} is unreachable: {e!r}", 502, "BadGatewayError")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        content_type = upstream.headers.get("content-type")
        return StreamingResponse(relay(), upstream.status_code, media_type=content_type)


def build_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    proxy = DisaggProxy(prefill_urls, decode_urls, transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        client = httpx.AsyncClient(timeout=None, limits=limits, transport=proxy.transport)
        async with client as proxy.client:
            yield

    routes = [
        Route("/v1/completions", proxy.generate, methods=["POST"]),
        Route("/v1/chat/completions", proxy.generate, methods=["POST"]),
        Route("/v1/models", proxy.passthrough, methods=["GET"]),
        Route("/health", proxy.passthrough, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def run_proxy(
    prefill_urls: list[str], decode_urls: list[str], host: str = "0.0.0.0", port: int = 8000
) -> None:
    """Serve the proxy until SIGTERM / Ctrl-C."""
    app = build_app(prefill_urls, decode_urls)
    logger.info("P/D proxy on %s:%d: prefill %s, decode %s", host, port, prefill_urls, decode_urls)
    uvicorn.run(app, host=host, port=port)
