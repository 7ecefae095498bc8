"""multimodal/media.py and url_policy.py: images from bytes, data: URLs, a local HTTP server
(sizes, time, statuses, redirects) and file:// URLs, every failure a ValueError naming the
problem; images bounded by their decoded size (a JPEG decoded reduced); the URL rules
(public addresses only unless JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS, --allowed-media-domains)
checked on the address dialled and on every redirect hop, with no connection made to a
refused address; and MultiModalConfig's parsing of the image flags.

A "public" host name is made by patching the system resolver (socket.getaddrinfo), and
reaching it by routing its dial to the local server (httpcore.AnyIOBackend.connect_tcp):
the policy code under test runs as it does for real."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import pytest
from PIL import Image

from jaxserve.config import DEFAULT_LIMIT_PER_PROMPT, MultiModalConfig
from jaxserve.multimodal import url_policy
from jaxserve.multimodal.media import (
    MAX_CONCURRENT_FETCHES,
    decode_data_url,
    fetch_image,
    fetch_images,
    load_image,
    load_image_url,
)
from jaxserve.multimodal.url_policy import ALLOW_PRIVATE_ENV, address_problem
from tests.require import require_or_skip

LIMITS = {"max_bytes": 1 << 20, "timeout": 5.0, "allowed_local_media_path": None}
PUBLIC = "93.184.215.14"  # a public address the tests' resolver gives their host names


def image_bytes(fmt: str = "PNG", size=(8, 6), color=(200, 10, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


def blank_png(width: int, height: int) -> bytes:
    """A valid black RGB PNG of any size, made in well under a second without its pixels in
    memory: one deflate block of rows, ended by a full flush (so it refers to nothing
    before it), repeated; a 9000x9000 one is ~236 KB, as a decompression bomb's."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    rows = max(d for d in range(1, 65) if height % d == 0)
    block = (b"\0" * (1 + width * 3)) * rows
    z = zlib.compressobj(9)
    deflated = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH)  # 2 bytes of header, then data
    adler = 1
    for _ in range(height // rows):
        adler = zlib.adler32(block, adler)
    stream = deflated[:2] + deflated[2:] * (height // rows) + b"\x03\x00" + struct.pack(">I", adler)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    png = chunk(b"IHDR", ihdr) + chunk(b"IDAT", stream) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + png


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def fetch(url: str, **limits) -> Image.Image:
    return asyncio.run(fetch_image(url, **{**LIMITS, **limits}))


def refusal(url: str, **limits) -> str:
    with pytest.raises(ValueError) as info:
        fetch(url, **limits)
    return str(info.value)


class MediaServer:
    """A local HTTP server: /img.png (and /img2.png, wider), /text (not an image), /big (no
    Content-Length, 2 MiB), /big-declared (Content-Length 2 MiB), /slow.png (answers after
    `delay` s), /redirect (302 to /img.png), /to?LOCATION (302 to LOCATION), /loop (302 to
    itself); anything else 404. `hits`: the paths asked for; `most_at_once`: the most
    requests it served at the same time."""

    def __init__(self, delay: float = 3.0, tls: ssl.SSLContext | None = None):
        png, png2 = image_bytes(), image_bytes(size=(16, 6))
        server = self
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                server.hits.append(self.path)
                with lock:
                    server.now += 1
                    server.most_at_once = max(server.most_at_once, server.now)
                try:
                    self.answer()
                finally:
                    with lock:
                        server.now -= 1

            def answer(self):
                path, _, query = self.path.partition("?")
                location = {"/redirect": "/img.png", "/to": query, "/loop": "/loop"}.get(path)
                if location is not None:
                    self.send_response(302)
                    self.send_header("Location", location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path in ("/slow.png", "/slow2.png"):
                    time.sleep(delay)
                body = {"/img.png": png, "/slow.png": png, "/slow2.png": png2, "/img2.png": png2,
                        "/text": b"hello, not an image", "/big": b"\0" * (2 << 20),
                        "/big-declared": b"\0" * (2 << 20)}.get(path)  # fmt: skip
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                if path != "/big":  # /big: read until the connection closes
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client may have given up
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.hits: list[str] = []
        self.now = self.most_at_once = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Listener:
    """A bound, listening socket no one accepts on: a connection made to it waits in its
    backlog, so `connections()` tells whether anything connected."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        count = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                self.sock.accept()[0].close()
                count += 1
        return count

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def shared_server():
    server = MediaServer()
    yield server
    server.close()


@pytest.fixture
def media_server(shared_server, monkeypatch):
    """The module's MediaServer, reachable: loopback addresses allowed by the env var."""
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
    return shared_server


@pytest.fixture
def default_rules(monkeypatch):
    """The default address rule (whatever the environment running the tests says)."""
    monkeypatch.delenv(ALLOW_PRIVATE_ENV, raising=False)


@pytest.fixture
def listener():
    sock = Listener()
    yield sock
    sock.close()


@pytest.fixture
def public_names(monkeypatch):
    """Host names ending in .example resolve to PUBLIC (the system resolver patched), and a
    dial of PUBLIC reaches 127.0.0.1 (the connection patched under the policy's check).
    Returns the addresses dialled."""
    resolve, dial = socket.getaddrinfo, httpcore.AnyIOBackend.connect_tcp
    dialled: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".example"):
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (PUBLIC, port))]
        return resolve(host, port, *args, **kwargs)

    async def connect_tcp(self, host, port, *args, **kwargs):
        dialled.append(host)
        return await dial(self, "127.0.0.1" if host == PUBLIC else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", connect_tcp)
    return dialled


# ---------------------------------------------------------------------- bytes, data URLs
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_data_urls_of_every_format_decode_to_rgb(fmt):
    image = fetch(data_url(image_bytes(fmt), f"image/{fmt.lower()}"))
    assert image.mode == "RGB" and image.size == (8, 6)
    r, g, b = image.getpixel((3, 3))
    assert abs(r - 200) < 30 and g < 50 and b < 60  # lossy formats come close


def test_transparency_goes_over_white_and_grey_becomes_rgb():
    clear = load_image(image_bytes(mode="RGBA", color=(0, 0, 0, 0)))
    assert clear.mode == "RGB" and clear.getpixel((0, 0)) == (255, 255, 255)
    half = load_image(image_bytes(mode="RGBA", color=(0, 0, 0, 128)))
    assert half.getpixel((0, 0)) == (127, 127, 127)
    assert load_image(image_bytes(mode="LA", color=(0, 0))).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([200, 10, 30, 0, 0, 0])  # index 1: black, transparent
    buf = io.BytesIO()
    palette.save(buf, format="PNG", transparency=1)
    assert load_image(buf.getvalue()).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(image_bytes(mode="L", color=7)).getpixel((0, 0)) == (7, 7, 7)


def test_a_payload_that_is_no_image_is_a_value_error():
    with pytest.raises(ValueError, match="image_url payload is not an image: not one of JPEG"):
        load_image(b"hello")
    with pytest.raises(ValueError, match=r"not an image.*\(from data:image/png;base64,\.\.\.\)"):
        fetch(data_url(b"hello"))
    with pytest.raises(ValueError, match="not an image") as info:  # a PNG cut short
        load_image(image_bytes(size=(300, 300))[:200])
    assert " at 0x" not in str(info.value)  # no object reprs
    with pytest.raises(ValueError, match="not one of JPEG, PNG, WEBP, GIF, BMP, TIFF"):
        load_image(image_bytes("PPM"))  # an image, of a kind not taken


def test_a_9000x9000_png_is_refused_before_it_is_decoded():
    """A 236 KB decompression bomb under Pillow's own limit: 81M pixels from its header."""
    bomb = blank_png(9000, 9000)
    assert len(bomb) < 300_000 and Image.open(io.BytesIO(bomb)).size == (9000, 9000)
    with pytest.raises(ValueError, match="too large an image: 9000x9000 pixels, over the "
                                         "16777216 an image is decoded to"):  # fmt: skip
        load_image(bomb)
    with pytest.raises(ValueError, match="too large an image"):
        fetch(data_url(bomb))
    assert load_image(blank_png(4096, 4096)).size == (4096, 4096)  # at the bound: taken


def test_a_24_megapixel_jpeg_is_decoded_at_half_size():
    buf = io.BytesIO()
    Image.new("RGB", (6000, 4000), (10, 120, 200)).save(buf, format="JPEG", quality=50)
    image = load_image(buf.getvalue())
    assert image.size == (3000, 2000) and image.mode == "RGB"
    r, g, b = image.getpixel((1500, 1000))
    assert abs(r - 10) < 8 and abs(g - 120) < 8 and abs(b - 200) < 8


def test_jpegs_decode_at_the_least_reduction_that_fits_and_other_formats_are_refused():
    jpeg = image_bytes("JPEG", size=(400, 300))
    assert load_image(jpeg, max_pixels=120_000).size == (400, 300)
    assert load_image(jpeg, max_pixels=119_999).size == (200, 150)
    assert load_image(jpeg, max_pixels=10_000).size == (100, 75)
    assert load_image(jpeg, max_pixels=1_900).size == (50, 38)  # 1/8, rounded up
    with pytest.raises(ValueError, match="400x300 pixels, over the 1000 an image is decoded"):
        load_image(jpeg, max_pixels=1000)  # past 1/8
    with pytest.raises(ValueError, match="400x300 pixels, over the 119999"):
        load_image(image_bytes("PNG", size=(400, 300)), max_pixels=119_999)


@pytest.mark.parametrize(
    "url, error",
    [
        ("data:image/png;base64,@@@notbase64@@@", "is not valid base64"),
        ("data:image/png;base64,abc", "is not valid base64"),  # bad padding
        ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain' is not an image type"),
        ("data:image/png,rawbytes", "Only base64 data URLs are supported"),
        ("data:image/png;base64", "is not a data URL"),
    ],
)
def test_bad_data_urls_are_value_errors_naming_the_problem(url, error):
    with pytest.raises(ValueError, match=error):
        decode_data_url(url)


def test_data_url_over_the_byte_limit_is_refused():
    url = data_url(image_bytes(size=(64, 64)))
    with pytest.raises(ValueError, match="is larger than 50 bytes"):
        fetch(url, max_bytes=50)


def test_other_schemes_are_refused():
    for url in ("ftp://example.com/a.png", "gopher://x", "/etc/passwd", "img.png"):
        with pytest.raises(ValueError, match="URL scheme .* is not supported"):
            fetch(url)


# ---------------------------------------------------------------------- http(s)
def test_an_http_image_is_fetched(media_server):
    assert fetch(f"{media_server.url}/img.png").size == (8, 6)


def test_http_failures_name_the_url_and_problem(media_server):
    url = media_server.url
    with pytest.raises(ValueError, match=f"could not fetch image from URL {url}/nope.png: HTTP "
                                         "status 404"):  # fmt: skip
        fetch(f"{url}/nope.png")
    with pytest.raises(ValueError, match=f"not an image.*from {url}/text"):
        fetch(f"{url}/text")
    with pytest.raises(ValueError, match="it is 2097152 bytes, over 1048576 bytes"):
        fetch(f"{url}/big-declared")  # refused by its Content-Length
    with pytest.raises(ValueError, match="it is larger than 1048576 bytes"):
        fetch(f"{url}/big")  # counted as it streams in
    with pytest.raises(ValueError, match="is not a valid URL"):
        fetch("http://[::1/x.png")


def test_network_failures_all_read_alike(media_server, monkeypatch):
    """A closed port, a server too slow, a name that does not resolve: the same words, none
    saying which (no port scanning through the server's answers)."""
    slow = f"{media_server.url}/slow.png"
    start = time.monotonic()
    assert refusal(slow, timeout=0.3) == f"could not fetch image from URL {slow}"
    assert time.monotonic() - start < 2
    closed = "http://127.0.0.1:9/a.png"  # the discard port: nothing listens
    assert refusal(closed) == f"could not fetch image from URL {closed}"

    def no_such_name(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    assert refusal("http://nowhere.invalid/a.png") == (
        "could not fetch image from URL http://nowhere.invalid/a.png"
    )


def test_redirects_are_followed_unless_the_env_var_says_not(media_server, monkeypatch):
    assert fetch(f"{media_server.url}/redirect").size == (8, 6)
    with pytest.raises(ValueError, match="more than 10 redirects"):
        fetch(f"{media_server.url}/loop")
    monkeypatch.setenv("JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS", "0")
    with pytest.raises(ValueError, match="HTTP status 302 .*JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS"):
        fetch(f"{media_server.url}/redirect")


def test_several_images_are_fetched_concurrently_in_order(monkeypatch):
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
    server = MediaServer(delay=0.5)
    try:
        urls = [f"{server.url}/slow2.png", f"{server.url}/slow.png", data_url(image_bytes())]
        start = time.monotonic()
        images = asyncio.run(fetch_images(urls, **LIMITS))
        assert time.monotonic() - start < 0.95  # two 0.5 s fetches side by side
        assert [i.size for i in images] == [(16, 6), (8, 6), (8, 6)]
        with pytest.raises(ValueError, match="HTTP status 404"):  # the first failure wins
            asyncio.run(fetch_images([f"{server.url}/slow.png", f"{server.url}/x"], **LIMITS))
    finally:
        server.close()


def test_one_call_fetches_at_most_a_few_urls_at_once(monkeypatch):
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
    server = MediaServer(delay=0.1)
    try:
        urls = [f"{server.url}/slow.png?{i}" for i in range(3 * MAX_CONCURRENT_FETCHES)]
        assert len(asyncio.run(fetch_images(urls, **LIMITS))) == len(urls)
        assert server.most_at_once <= MAX_CONCURRENT_FETCHES
    finally:
        server.close()


def test_the_sync_loader_works_inside_a_running_event_loop(media_server):
    async def notebook():  # LLM.chat called where a loop already runs
        return load_image_url(f"{media_server.url}/img.png", **LIMITS)

    assert asyncio.run(notebook()).size == (8, 6)


# ---------------------------------------------------------------------- the URL rules
@pytest.mark.parametrize(
    "host, shown",
    [
        ("127.0.0.1", "its address 127.0.0.1"),
        ("[::ffff:127.0.0.1]", "its address ::ffff:127.0.0.1"),
        ("2130706433", "an address its host resolves to"),  # 127.0.0.1 as one number
        ("localhost", "an address its host resolves to"),
    ],
)
def test_loopback_urls_are_refused_without_connecting(default_rules, listener, host, shown):
    url = f"http://{host}:{listener.port}/x.png"
    assert refusal(url) == (
        f"image URL {url} refused: {shown} is not public (set {ALLOW_PRIVATE_ENV}=1 to allow)"
    )
    assert listener.connections() == 0


def test_the_env_var_allows_private_addresses_but_never_metadata(media_server, monkeypatch):
    assert fetch(f"http://localhost:{media_server.port}/img.png").size == (8, 6)
    url = "http://169.254.169.254/latest/meta-data/"
    assert refusal(url).endswith("its address 169.254.169.254 is a cloud metadata address")
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "0")
    assert "is not public" in refusal(f"{media_server.url}/img.png")


@pytest.mark.parametrize(
    "address",
    ["10.0.0.1", "172.16.5.4", "192.168.0.1", "169.254.1.1", "100.64.0.1", "0.0.0.0",
     "224.0.0.1", "240.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1",
     "ff02::1", "::ffff:10.0.0.1", "64:ff9b::a00:1", "2002:a00:1::"],
)  # fmt: skip
def test_every_kind_of_non_public_address_is_refused(address):
    assert address_problem(address, allow_private=False).startswith("is not public")
    assert address_problem(address, allow_private=True) is None


@pytest.mark.parametrize(
    "address", ["169.254.169.254", "fd00:ec2::254", "100.100.100.200", "::ffff:169.254.169.254"]
)
def test_metadata_addresses_are_refused_always(address):
    assert address_problem(address, allow_private=True) == "is a cloud metadata address"


@pytest.mark.parametrize("address", ["8.8.8.8", PUBLIC, "2606:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address):
    assert address_problem(address, allow_private=False) is None


def test_a_name_is_checked_by_the_address_it_resolves_to(
    default_rules, public_names, shared_server, monkeypatch
):
    server = shared_server
    server.hits.clear()
    url = f"http://cdn.example:{server.port}/img.png"
    assert fetch(url).size == (8, 6)  # public: fetched (the Host header keeps the name)
    assert public_names == [PUBLIC]
    resolve = socket.getaddrinfo

    def to_loopback(host, port, *args, **kwargs):
        if host == "inside.example":
            return resolve("127.0.0.1", port, *args, **kwargs)
        return resolve(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", to_loopback)
    inside = f"http://inside.example:{server.port}/img.png"
    assert refusal(inside).endswith(
        f"an address its host resolves to is not public (set {ALLOW_PRIVATE_ENV}=1 to allow)"
    )
    assert server.hits == ["/img.png"] and public_names == [PUBLIC]


def test_a_name_is_resolved_once_and_the_checked_address_dialled(
    default_rules, public_names, listener, monkeypatch
):
    """DNS rebinding: a name that answers a public address, then 127.0.0.1, is dialled at
    the address that was checked, never at a second lookup's."""
    answers = iter([PUBLIC, "127.0.0.1", "127.0.0.1"])

    def rebinding(host, port, *args, **kwargs):
        address = next(answers)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    async def unreachable(self, host, port, *args, **kwargs):
        public_names.append(host)
        raise httpcore.ConnectError("unreachable")  # PUBLIC stands for a far host

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", unreachable)
    url = f"http://rebind.example:{listener.port}/x.png"
    assert refusal(url) == f"could not fetch image from URL {url}"
    assert public_names == [PUBLIC] and listener.connections() == 0


def test_every_redirect_hop_is_checked(default_rules, public_names, shared_server):
    """A public name redirecting to a private address, or outside the allowed domains, is
    refused before the hop is fetched."""
    server = shared_server
    server.hits.clear()
    to_loopback = f"http://cdn.example:{server.port}/to?http://127.0.0.1:{server.port}/img.png"
    assert refusal(to_loopback) == (
        f"image URL {to_loopback} refused (redirected to http://127.0.0.1:{server.port}/"
        f"img.png): its address 127.0.0.1 is not public (set {ALLOW_PRIVATE_ENV}=1 to allow)"
    )
    assert server.hits == [f"/to?http://127.0.0.1:{server.port}/img.png"]
    server.hits.clear()
    allowed = ("cdn.example",)
    away = f"http://cdn.example:{server.port}/to?http://other.example:{server.port}/img.png"
    assert refusal(away, allowed_media_domains=allowed).endswith(
        "img.png): its host 'other.example' is not in --allowed-media-domains"
    )
    assert len(server.hits) == 1
    hop = f"http://cdn.example:{server.port}/to?/img.png"  # a relative one, same host
    assert fetch(hop, allowed_media_domains=allowed).size == (8, 6)
    to_file = f"http://cdn.example:{server.port}/to?file:///etc/passwd"
    assert refusal(to_file).endswith("only http and https URLs are fetched, not 'file'")


def test_https_verifies_the_url_host_name_while_dialling_the_checked_address(
    default_rules, public_names, tmp_path, monkeypatch
):
    """TLS (SNI and the certificate's check) uses the URL's name, not the address dialled."""
    require_or_skip(None if shutil.which("openssl") else "no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=cdn.example",
         "-addext", "subjectAltName=DNS:cdn.example"],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    monkeypatch.setattr(url_policy, "_ssl_context", lambda: ssl.create_default_context(cafile=cert))
    server = MediaServer(tls=tls)
    try:
        assert fetch(f"https://cdn.example:{server.port}/img.png").size == (8, 6)
        other = f"https://other.example:{server.port}/img.png"  # the certificate is not its
        assert refusal(other) == f"could not fetch image from URL {other}"
        assert public_names == [PUBLIC, PUBLIC] and server.hits == ["/img.png"]
    finally:
        server.close()


def test_allowed_media_domains_are_exact_host_names(media_server):
    port = media_server.port
    allowed = ("localhost",)
    assert fetch(f"http://LOCALHOST:{port}/img.png", allowed_media_domains=allowed).size == (8, 6)
    hits = len(media_server.hits)
    for host in ("127.0.0.1", "sub.localhost", "localhost.evil"):
        url = f"http://{host}:{port}/img.png"
        assert refusal(url, allowed_media_domains=allowed) == (
            f"image URL {url} refused: its host {host!r} is not in --allowed-media-domains"
        )
    assert len(media_server.hits) == hits
    assert fetch(data_url(image_bytes()), allowed_media_domains=allowed).size == (8, 6)


def test_environment_proxies_are_not_used(media_server, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # would fail every fetch
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    assert fetch(f"{media_server.url}/img.png").size == (8, 6)


# ---------------------------------------------------------------------- file://
def test_local_files_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a b.png").write_bytes(image_bytes())
    (tmp_path / "secret.png").write_bytes(image_bytes())
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    with pytest.raises(ValueError, match="Cannot load local files without "
                                         "`--allowed-local-media-path`"):  # fmt: skip
        fetch(f"file://{allowed}/a%20b.png")
    assert fetch(f"file://{allowed}/a%20b.png", allowed_local_media_path=str(allowed)).size == (
        8, 6,
    )  # fmt: skip
    for outside in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png",
                    f"file://{allowed}/link.png"):  # fmt: skip
        with pytest.raises(ValueError, match="must be a subpath of `--allowed-local-media-path`"):
            fetch(outside, allowed_local_media_path=str(allowed))
    with pytest.raises(ValueError, match="no such file"):
        fetch(f"file://{allowed}/missing.png", allowed_local_media_path=str(allowed))
    with pytest.raises(ValueError, match="is larger than 10 bytes"):
        fetch(f"file://{allowed}/a%20b.png", allowed_local_media_path=str(allowed), max_bytes=10)
    with pytest.raises(ValueError, match="names host 'example.com'"):
        fetch("file://example.com/a.png", allowed_local_media_path=str(allowed))


# ---------------------------------------------------------------------- config
def test_multimodal_config_parses_vllms_forms(tmp_path):
    assert MultiModalConfig().limit("image") == DEFAULT_LIMIT_PER_PROMPT == 999
    assert MultiModalConfig.parse(None, None) == MultiModalConfig()
    assert MultiModalConfig.parse('{"image": 3}', None).limit("image") == 3
    assert MultiModalConfig.parse({"image": {"count": 2, "width": 512}}, None).limit("image") == 2
    assert MultiModalConfig.parse('{"image": 0, "video": 0}', None).limit("image") == 0
    parsed = MultiModalConfig.parse(None, str(tmp_path / "x" / ".."))
    assert parsed.allowed_local_media_path == str(tmp_path)


@pytest.mark.parametrize(
    "limits, error",
    [
        ('{"image": 3', "limit_mm_per_prompt '{\"image\": 3' is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"imagez": 1}', "unknown modality 'imagez'; jaxserve takes image"),
        ('{"image": -1}', r"limit_mm_per_prompt\['image'\] must be a non-negative integer, got -1"),
        ('{"image": true}', "must be a non-negative integer, got True"),
        ('{"image": 1.5}', "must be a non-negative integer, got 1.5"),
        ('{"video": 1}', "jaxserve takes no video inputs"),
    ],
)
def test_bad_limits_are_value_errors_naming_them(limits, error):
    with pytest.raises(ValueError, match=error):
        MultiModalConfig.parse(limits, None)


def test_allowed_media_domains_parse_as_host_names():
    parsed = MultiModalConfig.parse(None, None, ["Upload.Wikimedia.org", "cdn.example."])
    assert parsed.allowed_media_domains == ("upload.wikimedia.org", "cdn.example")
    assert MultiModalConfig.parse(None, None, []).allowed_media_domains is None  # vLLM's: any
    for bad in ("https://x.org", "x.org:443", "x.org/img", ""):
        with pytest.raises(ValueError, match=f"allowed_media_domains: {bad!r} is not a host"):
            MultiModalConfig.parse(None, None, [bad])
    with pytest.raises(ValueError, match="must be a list of host names, got 'x.org'"):
        MultiModalConfig.parse(None, None, "x.org")


def test_the_media_path_must_be_an_existing_directory(tmp_path):
    with pytest.raises(ValueError, match="allowed_local_media_path '.*/nope' does not exist"):
        MultiModalConfig.parse(None, str(tmp_path / "nope"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        MultiModalConfig.parse(None, str(tmp_path / "f"))
