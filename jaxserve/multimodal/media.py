"""Images from what a chat message names: bytes, data: URLs, http(s):// and file:// URLs.

Every failure is a ValueError naming the URL (a data URL by its header only) and the
problem, which the HTTP server answers with a 400: a payload that is not an image (of
IMAGE_FORMATS), an image of more than MAX_DECODED_PIXELS as decoded, a body over
`max_bytes` (counted as it streams in, after any Content-Encoding is undone), a URL a rule
of url_policy.py refuses (on any redirect hop), a status other than 2xx, a redirect when
JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS is off, a local file outside --allowed-local-media-path,
any other scheme. A fetch that fails on the network, or takes past `timeout` seconds in
all, is "could not fetch image from URL ..." whatever the cause, so the server's answers
tell nothing of hosts and ports it can reach. Decoding runs in a worker thread
(`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import logging
import re
import threading
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import httpx
from PIL import Image, UnidentifiedImageError

from jaxserve import envs
from jaxserve.multimodal.url_policy import MediaURLRefused, check_url, checked_client

logger = logging.getLogger(__name__)

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # --max-image-bytes' default; LLM.chat's limit
# The most pixels an image is decoded to (64 MiB: Pillow holds RGB and RGBA at 4 bytes a
# pixel), well above the 12.8M Qwen2.5-VL's processor keeps by default. A JPEG over it is
# decoded at 1/2, 1/4 or 1/8 scale, the least that fits (a 24-megapixel photo at 1/2: 6M);
# other formats have no reduced decode and are refused (a 9000x9000 PNG is 81M).
MAX_DECODED_PIXELS = 4096 * 4096
# Pillow's formats taken (JPEG includes the multi-picture JPEGs phones write): not EPS,
# whose decoding runs Ghostscript, nor other rarely sent kinds.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
MAX_CONCURRENT_FETCHES = 4  # images of one fetch_images call (one request) in flight at once
MAX_REDIRECTS = 10  # hops one image URL may take, each checked as the first
_open_lock = threading.Lock()  # warnings.catch_warnings is process-wide state
_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


class _TooLarge(Exception):
    pass


class _Answered(ValueError):
    """A fetch the host answered, wrongly (a status, a size, too many redirects)."""


def describe_url(url: str, limit: int = 200) -> str:
    """The URL as an error message names it: a data URL by its header, others cut short."""
    if url[:5].lower() == "data:":
        return url.split(",", 1)[0][:limit] + ",..."
    return url if len(url) <= limit else url[:limit] + "..."


def load_image(data: bytes, max_pixels: int = MAX_DECODED_PIXELS) -> Image.Image:
    """JPEG, PNG, WebP, GIF, BMP or TIFF bytes as an RGB image (transparency over white, as
    vLLM does), decoded to at most max_pixels: its header's size is read first, a JPEG
    over the bound is decoded at a reduced scale (Pillow's `draft`), anything else over it
    is refused before it is decoded. Only the RGB image is kept. ValueError if it is not an
    image or is too large."""
    buf = io.BytesIO(data)
    try:
        with _open_lock, warnings.catch_warnings():
            # Pillow's warning past ~89M pixels is moot: _reduce bounds the decoded size
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(buf, formats=IMAGE_FORMATS)  # reads the header only
        _reduce(image, max_pixels)
        image.load()
        return _rgb(image)
    except (_TooLarge, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url payload is too large an image: {e}") from None
    except UnidentifiedImageError:
        raise ValueError(
            f"image_url payload is not an image: not one of {', '.join(IMAGE_FORMATS)}"
        ) from None
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, ValueError, ...)
        what = _OBJECT_REPR.sub("the image", str(e))  # no object addresses in a reply
        raise ValueError(f"image_url payload is not an image: {what}") from None
    finally:
        buf.close()  # a loaded image needs its bytes no more


def _reduce(image: Image.Image, max_pixels: int) -> None:
    """Sets `image` (opened, not loaded) to decode at the least scale of 1, 1/2, 1/4, 1/8
    that has at most max_pixels, where its format can (JPEG); _TooLarge if it still has
    more."""
    w, h = image.size
    k = next((k for k in (1, 2, 4, 8) if -(-w // k) * -(-h // k) <= max_pixels), 8)
    if k > 1:
        image.draft(None, (max(1, w // k), max(1, h // k)))  # a no-op but for JPEG
    if image.size[0] * image.size[1] > max_pixels:
        raise _TooLarge(
            f"{w}x{h} pixels, over the {max_pixels} an image is decoded to (a JPEG is "
            "decoded at down to 1/8 scale, other formats at full size)"
        )


def _rgb(image: Image.Image) -> Image.Image:
    """The loaded `image` as RGB: itself when it is, else a converted copy (`image` closed,
    its memory freed); transparent pixels over white."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA") if image.mode != "RGBA" else image
        out = Image.new("RGB", image.size, (255, 255, 255))
        out.paste(rgba, mask=rgba)  # its alpha band
        rgba.close()
    else:
        out = image.convert("RGB")
    image.close()
    return out


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; ValueError for another media type, a
    URL that is not base64 or base64 that does not decode."""
    header, comma, payload = url.partition(",")
    if header[:5].lower() != "data:" or not comma:
        raise ValueError(f"{describe_url(url)} is not a data URL (data:image/...;base64,...)")
    media_type, *params = header[5:].split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise ValueError(f"data URL media type {media_type!r} is not an image type (image/...)")
    if "base64" not in (p.strip().lower() for p in params):
        raise ValueError("Only base64 data URLs are supported for images (data:image/...;base64,)")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URL {describe_url(url)} is not valid base64: {e}") from None


async def fetch_image(
    url: str,
    *,
    max_bytes: int,
    timeout: float,
    allowed_local_media_path: str | None,
    allowed_media_domains: tuple[str, ...] | None = None,
    client: httpx.AsyncClient | None = None,
) -> Image.Image:
    """The image `url` names (data:, http(s)://, file://); at most max_bytes of it, fetched
    within timeout seconds in all. allowed_media_domains: the hosts an http(s) URL may
    name (None: any). client: one of url_policy.checked_client to fetch http(s) URLs with
    (default: a new one)."""
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    except ValueError as e:  # urllib's "Invalid IPv6 URL"
        raise ValueError(f"image URL {describe_url(url)} is not a valid URL: {e}") from None
    if scheme == "data":
        data = await asyncio.to_thread(decode_data_url, url)
    elif scheme in ("http", "https"):
        data = await _download(url, max_bytes, timeout, allowed_media_domains, client)
    elif scheme == "file":
        data = await asyncio.to_thread(_read_local, url, allowed_local_media_path, max_bytes)
    else:
        raise ValueError(
            f"image_url {describe_url(str(url))}: the URL scheme {scheme!r} is not supported "
            "(use http://, https://, data: or file://)"
        )
    if len(data) > max_bytes:
        raise ValueError(f"image {describe_url(url)} is larger than {max_bytes} bytes")
    try:
        return await asyncio.to_thread(load_image, data)
    except ValueError as e:
        raise ValueError(f"{e} (from {describe_url(url)})") from None


async def fetch_images(
    urls: list[str],
    *,
    max_bytes: int,
    timeout: float,
    allowed_local_media_path: str | None,
    allowed_media_domains: tuple[str, ...] | None = None,
) -> list[Image.Image]:
    """fetch_image of every URL, at most MAX_CONCURRENT_FETCHES at a time, in order; the
    first failure cancels the rest."""
    gate = asyncio.Semaphore(MAX_CONCURRENT_FETCHES)

    async def one(url: str) -> Image.Image:
        async with gate:
            return await fetch_image(
                url,
                max_bytes=max_bytes,
                timeout=timeout,
                allowed_local_media_path=allowed_local_media_path,
                allowed_media_domains=allowed_media_domains,
                client=client,
            )

    async with _client() as client:
        tasks = [asyncio.ensure_future(one(url)) for url in urls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def load_image_urls(
    urls: list[str],
    *,
    max_bytes: int,
    timeout: float,
    allowed_local_media_path: str | None,
    allowed_media_domains: tuple[str, ...] | None = None,
) -> list[Image.Image]:
    """fetch_images for synchronous callers (LLM.chat): its own event loop, in a thread of its
    own, so it works where the caller already runs one (a notebook)."""
    coro = fetch_images(
        urls,
        max_bytes=max_bytes,
        timeout=timeout,
        allowed_local_media_path=allowed_local_media_path,
        allowed_media_domains=allowed_media_domains,
    )
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-media") as pool:
        return pool.submit(asyncio.run, coro).result()


def load_image_url(url: str, **limits) -> Image.Image:
    """One image, synchronously (load_image_urls, with its keyword arguments)."""
    (image,) = load_image_urls([url], **limits)
    return image


def _client() -> httpx.AsyncClient:
    return checked_client(envs.JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS, MAX_CONCURRENT_FETCHES)


async def _download(
    url: str,
    max_bytes: int,
    timeout: float,
    allowed_domains: tuple[str, ...] | None,
    client: httpx.AsyncClient | None,
) -> bytes:
    """The body `url` answers with, following redirects hop by hop, each hop's URL and
    address checked (url_policy.py)."""
    what = f"could not fetch image from URL {describe_url(url)}"
    redirects = envs.JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS
    owned = client is None
    client = client or _client()
    hops: list[httpx.URL] = []
    try:
        hops.append(httpx.URL(url))
        async with asyncio.timeout(timeout):
            while len(hops) <= MAX_REDIRECTS + 1:
                check_url(hops[-1], allowed_domains)
                async with client.stream("GET", hops[-1], timeout=timeout) as response:
                    if not (redirects and response.next_request is not None):
                        return await _body(response, what, max_bytes)
                    hops.append(response.next_request.url)
        raise _Answered(f"{what}: more than {MAX_REDIRECTS} redirects")
    except MediaURLRefused as e:
        hop = f" (redirected to {describe_url(str(hops[-1]))})" if len(hops) > 1 else ""
        raise ValueError(f"image URL {describe_url(url)} refused{hop}: {e.rule}") from None
    except httpx.InvalidURL as e:
        raise ValueError(f"image URL {describe_url(url)} is not a valid URL: {e}") from None
    except _Answered:
        raise
    except Exception as e:  # the network's (httpx's, httpcore's, OSError) or the timeout's
        logger.debug("%s: %s: %s", what, type(e).__name__, e)
        raise ValueError(what) from None
    finally:
        if owned:
            await client.aclose()


async def _body(response: httpx.Response, what: str, max_bytes: int) -> bytes:
    """A 2xx response's body, at most max_bytes of it."""
    if not response.is_success:
        hint = ""
        if response.is_redirect:
            hint = " (a redirect: JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS is off)"
        raise _Answered(f"{what}: HTTP status {response.status_code}{hint}")
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _Answered(f"{what}: it is {length} bytes, over {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise _Answered(f"{what}: it is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _read_local(url: str, allowed_local_media_path: str | None, max_bytes: int) -> bytes:
    """A file:// URL's bytes, when the file lies under allowed_local_media_path (vLLM's
    --allowed-local-media-path; its messages)."""
    if allowed_local_media_path is None:
        raise ValueError(
            f"Cannot load local files without `--allowed-local-media-path` ({describe_url(url)})"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file URL {describe_url(url)} names host {parts.netloc!r}: local only")
    path = Path(urllib.request.url2pathname(parts.path)).resolve()
    root = Path(allowed_local_media_path).resolve()
    if not path.is_relative_to(root):
        raise ValueError(
            f"The file path {describe_url(url)} must be a subpath of "
            f"`--allowed-local-media-path` {root}."
        )
    if not path.is_file():
        raise ValueError(f"{describe_url(url)}: no such file")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"image {describe_url(url)} is larger than {max_bytes} bytes")
    return data
