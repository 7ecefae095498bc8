"""Property-based fuzzing of the surfaces added since the first audit: /v1/responses,
/v1/messages (+ count_tokens), /tokenize with messages, prompt embeddings on /v1/completions
and images in chat messages, with the hostile payloads each invites.

Two apps: one over a real engine (a tiny random Llama with --enable-prompt-embeds, the byte
tokenizer) for the text surfaces, one over a stand-in engine core with a real tiny LLaVA's
config, tokenizer and image processor for images (everything an image costs happens in the
API process, before the core). Payloads: torch.save'd tensors, well-formed and hostile
(compressed entries, a deflate bomb, stride-0 and overlapping views, shapes past
max_model_len, a pickle naming os.system), images as data URLs (a 9000x9000 PNG bomb, a
24-megapixel JPEG, truncated and non-images) and URLs to loopback, private, metadata and local
addresses (a listener on loopback counts every connection), Responses items and Anthropic
blocks with hostile fields, over test_fuzz.py's hostile values. Properties, per batch of
bodies sent at once:
  - every answer is 200 or a 4xx with the API's error body (OpenAI's, or Anthropic's on
    /v1/messages), never a 5xx, never a hang;
  - the engine lives, and holds no request and no KV block after the batch;
  - no URL to a non-public address is ever dialled (the listener sees no connection);
  - the API process's peak RSS grows by at most MAX_BATCH_GROWTH over the batch (VmHWM,
    reset before each batch through /proc/self/clear_refs).
CI runs a fixed, derandomized set of examples; JAXSERVE_FUZZ_EXAMPLES=N runs N random ones.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json
import os
import pickle
import re
import socket
import struct
import threading
import zipfile
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from starlette.testclient import TestClient

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import FakeCore
from tests.entrypoints.openai import test_fuzz as fuzz
from tests.entrypoints.openai.test_fuzz import SEEDS, EngineBroken, encode, hostile, pick, texts
from tests.helpers import TINY, make_tiny_hf, make_tiny_tokenizer
from tests.multimodal.tiny_vlm import draw_image, make_tiny_llava

SERVED = "fuzz-model"
VOCAB = 259  # make_tiny_tokenizer's
HIDDEN = TINY["hidden_size"]
MAX_MODEL_LEN = 128
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=64,
              num_gpu_blocks_override=48, enable_prompt_embeds=True)  # fmt: skip
BATCH = 6
LOCAL_EXAMPLES = os.environ.get("JAXSERVE_FUZZ_EXAMPLES")
EXAMPLES = int(LOCAL_EXAMPLES or 40)
TIMEOUT_S = 60.0
# What one batch may add to the API process's peak RSS: far above what its honest requests
# cost (bodies under 1 MB, small images), far below what any of the bombs would (256 MiB
# inflated, 243 MB of decoded pixels, 512 MB of a stride-0 view), plus PHOTO_GROWTH for each
# 24-megapixel JPEG in the batch (decoded at 3000x2000, then the image processor's arrays).
MAX_BATCH_GROWTH = 96 * 2**20
PHOTO_GROWTH = 64 * 2**20
GOOD_IMAGES = ["png", "jpeg", "24 MP jpeg"]


# ---------------------------------------------------------------------- payloads
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _saved(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def _rezip(saved: bytes, method: int, replace: dict[str, Any] | None = None) -> bytes:
    """saved's archive rewritten with every entry compressed by `method`; replace: entry
    name suffix -> new content (bytes, or a callable writing into the entry)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            new = next((v for k, v in (replace or {}).items() if info.filename.endswith(k)),
                       None)  # fmt: skip
            target = zipfile.ZipInfo(info.filename)
            target.compress_type = method
            if callable(new):
                with dst.open(target, "w", force_zip64=True) as f:
                    new(f)
            else:
                dst.writestr(target, src.read(info) if new is None else new)
    return out.getvalue()


def _zeros(n_mib: int):
    def write(f) -> None:
        chunk = bytes(2**20)
        for _ in range(n_mib):
            f.write(chunk)

    return write


class _System:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@functools.cache
def embeds_payloads() -> dict[str, str]:
    """name -> base64 prompt_embeds, well-formed and hostile."""
    good = _saved(torch.randn(3, HIDDEN))
    payloads = {
        "f32": good,
        "f16": _saved(torch.randn(2, HIDDEN, dtype=torch.float16)),
        "bf16": _saved(torch.randn(4, HIDDEN, dtype=torch.bfloat16)),
        "transposed": _saved(torch.randn(HIDDEN, 2).t()),
        "wrong hidden": _saved(torch.randn(2, HIDDEN + 1)),
        "3-d": _saved(torch.randn(1, 2, HIDDEN)),
        "too long": _saved(torch.zeros(MAX_MODEL_LEN + 1, HIDDEN)),
        "stride 0": _saved(torch.zeros(1, HIDDEN).expand(2_000_000, HIDDEN)),
        "stride 0 huge": _saved(torch.zeros(1, 1).expand(10**7, 10**6)),
        "overlapping": _saved(torch.zeros(2 * HIDDEN).as_strided((64, HIDDEN), (1, 1))),
        "deflated": _rezip(good, zipfile.ZIP_DEFLATED),
        "bzip2": _rezip(good, zipfile.ZIP_BZIP2),
        "deflate bomb": _rezip(good, zipfile.ZIP_DEFLATED, {"data/0": _zeros(256)}),
        "os.system": _rezip(good, zipfile.ZIP_STORED, {"data.pkl": pickle.dumps(_System())}),
        "not a zip": b"PK\x03\x04" + bytes(64),
    }
    out = {name: _b64(data) for name, data in payloads.items()}
    out["not base64"] = "%%%not base64%%%"
    return out


def _png_of_zeros(width: int, height: int) -> bytes:
    """A grayscale PNG of zeros, its IDAT streamed (a decompression bomb of a few KB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    z = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte 0, then the pixels
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{_b64(data)}"


@functools.cache
def image_urls(port: int) -> dict[str, str]:
    """name -> image URL, well-formed and hostile; `port`: the counting listener's."""
    small = _encoded(draw_image(1, 40, 30), "PNG")
    photo = _encoded(Image.new("RGB", (6000, 4000), (90, 120, 200)), "JPEG", quality=80)
    loop = f"127.0.0.1:{port}"
    return {
        "png": _data_url(small),
        "jpeg": _data_url(_encoded(draw_image(2, 50, 40), "JPEG"), "image/jpeg"),
        "24 MP jpeg": _data_url(photo, "image/jpeg"),
        "png bomb": _data_url(_png_of_zeros(9000, 9000)),
        "truncated": _data_url(small[:100]),
        "not an image": _data_url(b"GIF89a" + bytes(64), "image/gif"),
        "text": "data:text/plain;base64," + _b64(b"hello"),
        "not base64": "data:image/png;base64,%%%",
        "loopback": f"http://{loop}/x.png",
        "localhost": f"http://localhost:{port}/x.png",
        "loopback v6": f"http://[::1]:{port}/x.png",
        "mapped v6": f"http://[::ffff:127.0.0.1]:{port}/x.png",
        "unspecified": f"http://0.0.0.0:{port}/x.png",
        "decimal host": f"http://2130706433:{port}/x.png",
        "https loopback": f"https://{loop}/x.png",
        "metadata": "http://169.254.169.254/latest/meta-data/",
        "private": "http://10.0.0.1/x.png",
        "file": "file:///etc/passwd",
        "ftp": "ftp://example.com/x.png",
    }


# ---------------------------------------------------------------------- strategies
def plausible_messages(kind: str) -> st.SearchStrategy:
    """Chat (OpenAI) or Anthropic messages: text, or text parts."""
    part_type = "text"
    content = st.one_of(
        texts, st.lists(st.fixed_dictionaries({"type": st.just(part_type), "text": texts}),
                        min_size=1, max_size=2),
    )  # fmt: skip
    roles = ["user", "assistant"] if kind == "anthropic" else ["system", "user", "assistant"]
    message = st.fixed_dictionaries({"role": st.sampled_from(roles), "content": content})
    return st.lists(message, min_size=1, max_size=3)


ITEMS = st.one_of(
    st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user",
                           "system", "assistant", "developer"]),
                           "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
                               {"type": st.just("input_text"), "text": texts}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("reasoning"),
                           "summary": st.one_of(st.lists(st.fixed_dictionaries(
                               {"type": st.just("summary_text"), "text": texts}), max_size=2),
                               hostile({"array"}), hostile(set()))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts, "name": texts,
                           "arguments": texts}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": texts,
                           "output": st.one_of(texts, hostile(set()))}),
    st.fixed_dictionaries({"type": st.just("image"), "image_url": texts}),
)  # fmt: skip
FREE_FORM = st.one_of(hostile({"object"}), st.dictionaries(texts, texts, max_size=3))
PLAUSIBLE = {
    "responses": dict(
        model=st.sampled_from([SERVED, None]),
        input=st.one_of(texts.filter(bool), st.lists(ITEMS, min_size=1, max_size=3)),
        instructions=texts,
        max_output_tokens=st.integers(1, 4),
        temperature=st.floats(0, 2),
        reasoning=st.one_of(st.fixed_dictionaries({"effort": st.sampled_from(
            ["low", "medium", "high", "none", 5])}), FREE_FORM),
        text=st.one_of(st.just({"format": {"type": "text"}}),
                       st.just({"format": {"type": "json_object"}}),
                       st.fixed_dictionaries({"format": FREE_FORM})),
        metadata=FREE_FORM,
        tool_choice=st.one_of(st.sampled_from(["none", "auto"]), FREE_FORM),
        store=st.booleans(),
        previous_response_id=st.sampled_from(["resp_0", "x" * 300]),
        stream=st.booleans(),
    ),
    "messages": dict(
        model=st.sampled_from([SERVED, None]),
        messages=plausible_messages("anthropic"),
        max_tokens=st.integers(1, 4),
        system=st.one_of(texts, st.lists(st.fixed_dictionaries(
            {"type": st.just("text"), "text": texts}), max_size=2)),
        stop_sequences=st.lists(texts.filter(bool), max_size=2),
        temperature=st.floats(0, 1),
        top_k=st.integers(-1, 20),
        metadata=FREE_FORM,
        stream=st.booleans(),
    ),
    "count_tokens": dict(messages=plausible_messages("anthropic"), system=texts),
    "tokenize": dict(messages=plausible_messages("chat"), add_generation_prompt=st.booleans(),
                     chat_template_kwargs=FREE_FORM),
    "embeds": dict(max_tokens=st.integers(1, 4), temperature=st.sampled_from([0.0, 1.0]),
                   stream=st.booleans()),
}  # fmt: skip
REQUIRED = {"responses": "input", "messages": "messages", "count_tokens": "messages",
            "tokenize": "messages"}  # fmt: skip
PATHS = {"responses": "/v1/responses", "messages": "/v1/messages",
         "count_tokens": "/v1/messages/count_tokens", "tokenize": "/tokenize",
         "embeds": "/v1/completions", "images": "/v1/chat/completions"}  # fmt: skip


@dataclasses.dataclass
class Case:
    route: str
    body: bytes
    note: str
    content_type = "application/json"

    def __repr__(self) -> str:
        body = self.body if len(self.body) <= 400 else self.body[:400] + b"..."
        return f"POST {self.path} ({self.note}) {body!r}"

    @property
    def path(self) -> str:
        return PATHS[self.route]


def _finish(rnd, draw, route: str, body: dict, notes: list[str]) -> Case:
    """One hostile field in a third of the bodies, then the body as JSON."""
    if rnd.random() < 0.35:
        key = rnd.choice(sorted(PLAUSIBLE.get(route, {})) or ["messages"])
        body[key] = draw(hostile(set()))
        notes.append(f"{key}=hostile")
    return Case(route, encode(body).encode("utf-8", "surrogatepass"), " ".join(notes))


@st.composite
def text_cases(draw: st.DrawFn) -> Case:
    rnd = draw(SEEDS)
    route = rnd.choice(["responses", "responses", "messages", "messages", "count_tokens",
                        "tokenize", "embeds", "embeds", "embeds"])  # fmt: skip
    body = draw(st.fixed_dictionaries({}, optional=PLAUSIBLE[route]))
    notes = [route]
    if route == "embeds":
        names = draw(st.lists(pick(sorted(embeds_payloads())), min_size=1, max_size=2))
        encoded = [embeds_payloads()[n] for n in names]
        body["prompt_embeds"] = encoded[0] if len(encoded) == 1 else encoded
        notes.append("+".join(names))
    elif REQUIRED[route] not in body:
        body[REQUIRED[route]] = draw(PLAUSIBLE[route][REQUIRED[route]])
    return _finish(rnd, draw, route, body, notes)


def image_cases(port: int) -> st.SearchStrategy:
    @st.composite
    def draw_case(draw: st.DrawFn) -> Case:
        rnd = draw(SEEDS)
        names = sorted(image_urls(port)) if rnd.random() < 0.5 else GOOD_IMAGES
        names = draw(st.lists(pick(names), min_size=1, max_size=3))
        parts = [{"type": "text", "text": draw(texts)}]
        parts += [{"type": "image_url", "image_url": {"url": image_urls(port)[n]}} for n in names]
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2,
                "stream": draw(st.booleans())}  # fmt: skip
        return _finish(rnd, draw, "images", body, ["+".join(names)])

    return draw_case()


# ---------------------------------------------------------------------- the servers
class Listener:
    """A loopback TCP listener counting the connections made to it (none may be)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def peak_rss_reset() -> int:
    """Resets the process's peak RSS to its RSS now (Linux >= 4.0); the RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


class Server(fuzz.Server):
    """test_fuzz's app driver, measuring each batch's peak RSS; real: over a real engine
    (whose state is checked), else over the stand-in core."""

    def __init__(self, client: TestClient, engine: AsyncLLM, real: bool):
        self.real = real
        super().__init__(client, engine)

    def send(self, batch: list[Case]) -> tuple[list[fuzz.Result], int]:
        """The answers, and how much the batch raised the process's peak RSS."""
        before = peak_rss_reset()
        results = super().send(batch)
        return results, _status("VmHWM") - before

    def state(self) -> dict | None:
        return super().state() if self.real else None


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz")
    assert make_tiny_tokenizer(model) == VOCAB
    make_tiny_hf("llama", model, vocab_size=VOCAB)
    embeds_payloads()  # built before any batch measures the process's memory
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model), **ENGINE))
    app = build_app(engine, [SERVED], log_stats_interval=None)
    with TestClient(app) as client:
        yield Server(client, engine, real=True)


@pytest.fixture(scope="module")
def listener():
    server = Listener()
    yield server
    server.close()


@pytest.fixture(scope="module")
def image_server(tmp_path_factory, listener):
    """The app over a stand-in core, with a tiny LLaVA's config, tokenizer and processor."""
    model = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    image_urls(listener.port)
    config = EngineArgs(model=str(model), max_model_len=256).create_engine_config()
    engine = AsyncLLM(config, FakeCore(), tokenizer=read_tokenizer(str(model)))
    app = build_app(engine, [SERVED], log_stats_interval=None)
    with TestClient(app) as client:
        yield Server(client, engine, real=False)


# ---------------------------------------------------------------------- properties
SERVER_FAULTS = {"InternalServerError", "ServiceUnavailableError", "api_error",
                 "overloaded_error"}  # fmt: skip


def error_of(route: str, body: bytes, status: int) -> str | None:
    """What is wrong with an error body (OpenAI's, Anthropic's on /v1/messages), or None."""
    try:
        answer = json.loads(body)
        if route in ("messages", "count_tokens"):
            ok = answer["type"] == "error" and isinstance(answer["error"]["message"], str)
        else:
            error = answer["error"]
            ok = isinstance(error["message"], str) and error["code"] == status
    except (ValueError, KeyError, TypeError):
        ok = False
    return None if ok else f"status {status} without the API's error body"


def stream_error(event: Any) -> str | None:
    """A server-side fault in a streamed event of any API (an error event of OpenAI's chat
    and completions carries its HTTP code, the Responses API's its kind, Anthropic's its
    type), or None."""
    if not isinstance(event, dict):
        return None
    error = event.get("error")
    if event.get("type") == "error" and "code" in event:  # the Responses API's error event
        return None if event["code"] not in SERVER_FAULTS else str(event)[:300]
    if not isinstance(error, dict):
        return None
    code, kind = error.get("code"), error.get("type")
    if isinstance(code, int):
        return None if 400 <= code < 500 else str(event)[:300]
    return str(event)[:300] if kind in SERVER_FAULTS or kind is None else None


def problem(case: Case, r: fuzz.Result) -> str | None:
    if r.status is None:
        return f"no answer within {TIMEOUT_S} s"
    if not (r.status == 200 or 400 <= r.status < 500):
        return f"status {r.status}"
    if r.status != 200:
        return error_of(case.route, r.body, r.status)
    if not r.content_type.startswith("text/event-stream"):
        try:
            json.loads(r.body)
        except ValueError:
            return "a 200 whose body is not JSON"
        return None
    events = [line[6:] for line in r.body.decode().split("\n") if line.startswith("data: ")]
    if not events:
        return "an empty stream"
    for data in events:
        if data == "[DONE]":
            continue
        try:
            fault = stream_error(json.loads(data))
        except ValueError:
            return f"a stream event that is not JSON: {data[:200]!r}"
        if fault:
            return f"a stream error event {fault}"
    return None


def check_batch(server: Server, batch: list[Case], results, growth: int) -> None:
    photos = sum(case.note.count("24 MP jpeg") for case in batch if case.route == "images")
    if server.health() != 200:
        raise EngineBroken(f"/health is not 200 after {batch}")
    if server.real:
        try:
            state = server.state()
        except (EngineDeadError, TimeoutError) as e:
            raise EngineBroken(f"the engine died ({e}) in the batch {batch}") from e
        for key in ("num_requests", "num_free_blocks"):
            if state[key] != server.idle[key]:
                raise EngineBroken(f"{key} is {state[key]} after {batch}, idle {server.idle[key]}")
    wrong = [(c, p, r) for c, r in zip(batch, results, strict=True) if (p := problem(c, r))]
    assert not wrong, "\n".join(f"{p}: {c!r} -> {r.body[:300]!r}" for c, p, r in wrong)
    bound = MAX_BATCH_GROWTH + photos * PHOTO_GROWTH
    assert growth <= bound, (
        f"the batch raised the API process's peak RSS by {growth / 2**20:.0f} MiB, over "
        f"{bound / 2**20:.0f}: {batch}"
    )


FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=LOCAL_EXAMPLES is None,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


@FUZZ
@given(batch=st.lists(text_cases(), min_size=BATCH, max_size=BATCH))
def test_fuzz_responses_messages_tokenize_and_prompt_embeds(text_server, batch):
    results, growth = text_server.send(batch)
    check_batch(text_server, batch, results, growth)


@FUZZ
@given(data=st.data())
def test_fuzz_images(image_server, listener, data):
    batch = data.draw(st.lists(image_cases(listener.port), min_size=BATCH, max_size=BATCH))
    results, growth = image_server.send(batch)
    assert listener.accepted == 0, f"a request dialled the loopback listener: {batch}"
    check_batch(image_server, batch, results, growth)
