"""multimodal/media.py: images from bytes, data: URLs, a local HTTP server (sizes, time,
statuses, redirects) and file:// URLs, every failure a ValueError naming the problem; and
MultiModalConfig's parsing of --limit-mm-per-prompt / --allowed-local-media-path."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from jaxserve.config import DEFAULT_LIMIT_PER_PROMPT, MultiModalConfig
from jaxserve.multimodal.media import (
    decode_data_url,
    fetch_image,
    fetch_images,
    load_image,
    load_image_url,
)

LIMITS = {"max_bytes": 1 << 20, "timeout": 5.0, "allowed_local_media_path": None}


def image_bytes(fmt: str = "PNG", size=(8, 6), color=(200, 10, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def fetch(url: str, **limits) -> Image.Image:
    return asyncio.run(fetch_image(url, **{**LIMITS, **limits}))


class MediaServer:
    """A local HTTP server: /img.png (and /img2.png, wider), /text (not an image), /big (no
    Content-Length, 2 MiB), /big-declared (Content-Length 2 MiB), /slow.png (answers after
    `delay` s), /redirect (302 to /img.png); anything else 404."""

    def __init__(self, delay: float = 3.0):
        png, png2 = image_bytes(), image_bytes(size=(16, 6))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                server.hits.append(self.path)
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "/img.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path in ("/slow.png", "/slow2.png"):
                    time.sleep(delay)
                body = {"/img.png": png, "/slow.png": png, "/slow2.png": png2, "/img2.png": png2,
                        "/text": b"hello, not an image", "/big": b"\0" * (2 << 20),
                        "/big-declared": b"\0" * (2 << 20)}.get(self.path)  # fmt: skip
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                if self.path != "/big":  # /big: read until the connection closes
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client may have given up
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.hits: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def media_server():
    server = MediaServer()
    yield server
    server.close()


# ---------------------------------------------------------------------- bytes, data URLs
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_data_urls_of_every_format_decode_to_rgb(fmt):
    image = fetch(data_url(image_bytes(fmt), f"image/{fmt.lower()}"))
    assert image.mode == "RGB" and image.size == (8, 6)
    r, g, b = image.getpixel((3, 3))
    assert abs(r - 200) < 30 and g < 50 and b < 60  # lossy formats come close


def test_transparency_goes_over_white_and_grey_becomes_rgb():
    clear = load_image(image_bytes(mode="RGBA", color=(0, 0, 0, 0)))
    assert clear.mode == "RGB" and clear.getpixel((0, 0)) == (255, 255, 255)
    assert load_image(image_bytes(mode="L", color=7)).getpixel((0, 0)) == (7, 7, 7)


def test_a_payload_that_is_no_image_is_a_value_error():
    with pytest.raises(ValueError, match="image_url payload is not an image: cannot identify"):
        load_image(b"hello")
    with pytest.raises(ValueError, match=r"not an image.*\(from data:image/png;base64,\.\.\.\)"):
        fetch(data_url(b"hello"))
    with pytest.raises(ValueError, match="not an image"):  # a PNG cut short
        load_image(image_bytes(size=(300, 300))[:200])


def test_a_decompression_bomb_is_a_value_error(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ValueError, match="too large an image"):
        load_image(image_bytes(size=(40, 40)))  # 1600 pixels: Pillow's warning, made an error
    with pytest.raises(ValueError, match="too large an image"):
        load_image(image_bytes(size=(50, 50)))  # over twice the limit: Pillow's error
    assert load_image(image_bytes(size=(30, 30))).size == (30, 30)


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


def test_a_slow_server_times_out(media_server):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"could not fetch image from URL .*/slow.png: timed out "
                                         r"after 0.3 s"):  # fmt: skip
        fetch(f"{media_server.url}/slow.png", timeout=0.3)
    assert time.monotonic() - start < 2


def test_an_unreachable_host_is_a_value_error():
    with pytest.raises(ValueError, match="could not fetch image from URL http://127.0.0.1:9/"):
        fetch("http://127.0.0.1:9/a.png")  # the discard port: nothing listens


def test_redirects_are_followed_unless_the_env_var_says_not(media_server, monkeypatch):
    assert fetch(f"{media_server.url}/redirect").size == (8, 6)
    monkeypatch.setenv("JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS", "0")
    with pytest.raises(ValueError, match="HTTP status 302 .*JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS"):
        fetch(f"{media_server.url}/redirect")


def test_several_images_are_fetched_concurrently_in_order():
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


def test_the_sync_loader_works_inside_a_running_event_loop(media_server):
    async def notebook():  # LLM.chat called where a loop already runs
        return load_image_url(f"{media_server.url}/img.png", **LIMITS)

    assert asyncio.run(notebook()).size == (8, 6)


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


def test_the_media_path_must_be_an_existing_directory(tmp_path):
    with pytest.raises(ValueError, match="allowed_local_media_path '.*/nope' does not exist"):
        MultiModalConfig.parse(None, str(tmp_path / "nope"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        MultiModalConfig.parse(None, str(tmp_path / "f"))
