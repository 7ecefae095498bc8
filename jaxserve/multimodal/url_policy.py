"""Which image URLs the server may fetch: the rules every hop of a fetch is checked against.

- Scheme: http and https only.
- Domain: with --allowed-media-domains (vLLM's flag), the URL's host must be one of those
  exact host names.
- Address: the address actually dialled must be public: not loopback, private, link-local,
  shared (100.64/10), unspecified, multicast or reserved, IPv4 or IPv6 (an IPv4-mapped,
  NAT64 or 6to4 IPv6 address by the IPv4 address inside it). Setting
  JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS=1 allows those (newer vLLM's
  VLLM_MEDIA_URL_ALLOW_PRIVATE_IPS). A cloud metadata address is refused whatever the
  variable says: no image is served from one.

The address rule lives in the connection itself (`CheckedBackend`, httpcore's network
backend): a host name is resolved once, every address it resolves to is checked, and the
connection goes to a checked address, never to a second lookup's answer, so a name that
resolves to a public address when checked and to 127.0.0.1 when dialled (DNS rebinding)
gets nothing. TLS and the Host header still use the URL's host name. Proxies from the
environment are not used: through one the dialled address would be the proxy's.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from collections.abc import Iterable

import httpcore
import httpx

ALLOW_PRIVATE_ENV = "JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS"
# Instance metadata services (AWS, ECS, GCP, Azure, Alibaba, Oracle...), refused always:
# most are link-local or private anyway; Azure's is a public address.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "169.254.170.2",
        "fd00:ec2::254",
        "100.100.100.200",
        "168.63.129.16",
        "192.0.0.192",
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class MediaURLRefused(ValueError):
    """A URL a rule refuses; `rule` says which (the caller names the URL)."""

    def __init__(self, rule: str):
        super().__init__(rule)
        self.rule = rule


def address_problem(address: str, allow_private: bool) -> str | None:
    """Why `address` (an IP address as text) may not be dialled, or None when it may."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone names an interface
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:  # a NAT64 gateway dials the IPv4 address in its last 32 bits
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        elif ip.sixtofour is not None:  # 2002::/16: a 6to4 relay dials the IPv4 inside
            ip = ip.sixtofour
    if ip in METADATA_ADDRESSES:
        return "is a cloud metadata address"
    if allow_private:
        return None
    public = ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)
    return None if public else f"is not public (set {ALLOW_PRIVATE_ENV}=1 to allow)"


def check_url(url: httpx.URL, allowed_domains: Iterable[str] | None) -> None:
    """MediaURLRefused unless `url` is http(s) and, when `allowed_domains` is given, its host
    is one of them."""
    if url.scheme not in ("http", "https"):
        raise MediaURLRefused(f"only http and https URLs are fetched, not {url.scheme!r}")
    if allowed_domains is None:
        return
    host = url.host.lower().rstrip(".")
    ascii_host = url.raw_host.decode("ascii").lower().rstrip(".")
    if host not in allowed_domains and ascii_host not in allowed_domains:
        raise MediaURLRefused(f"its host {host!r} is not in --allowed-media-domains")


class CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend that dials only addresses `address_problem` allows:
    MediaURLRefused for a host that resolves to any other (even among allowed ones)."""

    def __init__(self, allow_private: bool):
        self.allow_private = allow_private
        self._dial = httpcore.AnyIOBackend()

    async def connect_tcp(
        self, host, port, timeout=None, local_address=None, socket_options=None
    ) -> httpcore.AsyncNetworkStream:
        addresses = await _resolve(host, port)
        for address in addresses:
            problem = address_problem(address, self.allow_private)
            if problem is not None:
                literal = address == host.strip("[]")
                what = f"its address {address}" if literal else "an address its host resolves to"
                raise MediaURLRefused(f"{what} {problem}")
        error: Exception | None = None
        for address in addresses:  # each checked address, until one answers
            try:
                return await self._dial.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout, OSError) as e:
                error = e
        raise error or httpcore.ConnectError(f"{host} resolves to no address")

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise MediaURLRefused("unix sockets are not dialled")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def _resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (itself when it is an address), each once, in
    the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class CheckedTransport(httpx.AsyncBaseTransport):
    """httpx's transport over a CheckedBackend (httpx's own takes no network backend). Its
    errors are httpcore's, unmapped: the caller treats every one alike."""

    def __init__(self, allow_private: bool, max_connections: int):
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=_ssl_context(),
            max_connections=max_connections,
            network_backend=CheckedBackend(allow_private),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        target = httpcore.URL(
            scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
        )
        response = await self._pool.handle_async_request(
            httpcore.Request(
                request.method,
                target,
                headers=request.headers.raw,
                content=request.stream,
                extensions=request.extensions,
            )
        )
        return httpx.Response(
            response.status,
            headers=response.headers,
            stream=_Body(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream):
        self._stream = stream

    async def __aiter__(self):
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One verifying context for every client (building one reads the CA bundle)."""
    return httpx.create_ssl_context(trust_env=False)


def checked_client(allow_private: bool, max_connections: int) -> httpx.AsyncClient:
    """A client whose every connection is address-checked, with no proxy from the
    environment and no redirects followed by itself (the caller checks each hop's URL)."""
    transport = CheckedTransport(allow_private, max_connections)
    return httpx.AsyncClient(transport=transport, trust_env=False, follow_redirects=False)
