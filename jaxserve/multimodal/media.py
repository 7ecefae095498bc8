"""Images from what a chat message names: bytes, data: URLs, http(s):// and file:// URLs.

Every failure is a ValueError naming the URL (a data URL by its header only) and the
problem, which the HTTP server answers with a 400: a payload that is not an image, an image
over Pillow's pixel limit (a decompression bomb), a body over `max_bytes` (counted as it
streams in, after any Content-Encoding is undone), a fetch past `timeout` seconds in all, a
status other than 2xx, a redirect when JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS is off, a local
file outside --allowed-local-media-path, any other scheme. Decoding runs in a worker thread
(`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import threading
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import httpx
from PIL import Image

from jaxserve import envs

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # --max-image-bytes' default; LLM.chat's limit
_open_lock = threading.Lock()  # warnings.catch_warnings is process-wide state


def describe_url(url: str, limit: int = 200) -> str:
    """The URL as an error message names it: a data URL by its header, others cut short."""
    if url[:5].lower() == "data:":
        return url.split(",", 1)[0][:limit] + ",..."
    return url if len(url) <= limit else url[:limit] + "..."


def load_image(data: bytes) -> Image.Image:
    """PNG, JPEG, WebP or anything else Pillow reads, fully decoded, as RGB (transparency
    over white, as vLLM does). ValueError if it is not an image or has more pixels than
    Pillow's Image.MAX_IMAGE_PIXELS (a decompression bomb)."""
    try:
        with _open_lock, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
        image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url payload is too large an image: {e}") from None
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, ValueError, ...)
        raise ValueError(f"image_url payload is not an image: {e}") from None
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


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
    client: httpx.AsyncClient | None = None,
) -> Image.Image:
    """The image `url` names (data:, http(s)://, file://); at most max_bytes of it, fetched
    within timeout seconds in all. client: the one to fetch http(s) URLs with (default: a
    new one)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    if scheme == "data":
        data = await asyncio.to_thread(decode_data_url, url)
    elif scheme in ("http", "https"):
        data = await _download(url, max_bytes, timeout, client)
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
    urls: list[str], *, max_bytes: int, timeout: float, allowed_local_media_path: str | None
) -> list[Image.Image]:
    """fetch_image of every URL, concurrently, in order; the first failure cancels the rest."""
    async with httpx.AsyncClient() as client:
        tasks = [
            asyncio.ensure_future(fetch_image(
                url, max_bytes=max_bytes, timeout=timeout,
                allowed_local_media_path=allowed_local_media_path, client=client,
            ))
            for url in urls
        ]  # fmt: skip
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def load_image_urls(
    urls: list[str], *, max_bytes: int, timeout: float, allowed_local_media_path: str | None
) -> list[Image.Image]:
    """fetch_images for synchronous callers (LLM.chat): its own event loop, in a thread of its
    own, so it works where the caller already runs one (a notebook)."""
    coro = fetch_images(
        urls, max_bytes=max_bytes, timeout=timeout,
        allowed_local_media_path=allowed_local_media_path,
    )  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-media") as pool:
        return pool.submit(asyncio.run, coro).result()


def load_image_url(
    url: str, *, max_bytes: int, timeout: float, allowed_local_media_path: str | None
) -> Image.Image:
    """One image, synchronously (load_image_urls)."""
    (image,) = load_image_urls(
        [url], max_bytes=max_bytes, timeout=timeout,
        allowed_local_media_path=allowed_local_media_path,
    )  # fmt: skip
    return image


async def _download(
    url: str, max_bytes: int, timeout: float, client: httpx.AsyncClient | None
) -> bytes:
    what = f"could not fetch image from URL {describe_url(url)}"
    redirects = envs.JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS
    owned = client is None
    client = client or httpx.AsyncClient()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream(
                "GET", url, follow_redirects=redirects, timeout=timeout
            ) as response:
                if not response.is_success:
                    hint = ""
                    if response.is_redirect and not redirects:
                        hint = " (a redirect: JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS is off)"
                    raise ValueError(f"{what}: HTTP status {response.status_code}{hint}")
                length = response.headers.get("content-length", "")
                if length.isdigit() and int(length) > max_bytes:
                    raise ValueError(f"{what}: it is {length} bytes, over {max_bytes} bytes")
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise ValueError(f"{what}: it is larger than {max_bytes} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
    except TimeoutError:
        raise ValueError(f"{what}: timed out after {timeout:g} s") from None
    except httpx.TimeoutException:
        raise ValueError(f"{what}: timed out after {timeout:g} s") from None
    except httpx.HTTPError as e:
        raise ValueError(f"{what}: {type(e).__name__}: {e}") from None
    finally:
        if owned:
            await client.aclose()


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
