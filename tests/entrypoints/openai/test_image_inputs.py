"""Image inputs through the OpenAI chat API (the real starlette app, in process, over a
stand-in engine core) and LLM.chat: vLLM's content parts, its 400s (too many images, a text-
only model, unreachable or non-image URLs, local files without --allowed-local-media-path,
URLs to non-public addresses or outside --allowed-media-domains), the images reaching the
engine in order with the model's markers in the prompt, and the flags
(--limit-mm-per-prompt, --allowed-local-media-path, --allowed-media-domains,
--max-image-bytes)."""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace

import httpx
import pytest

from jaxserve.config import MultiModalConfig
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.cli import parse_args
from jaxserve.entrypoints.cli_args import engine_args_from
from jaxserve.entrypoints.llm import LLM
from jaxserve.entrypoints.openai import serving_chat
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.chat_media import default_chat_template, model_chat_template
from jaxserve.entrypoints.openai.server_setup import check_server_args
from jaxserve.multimodal.url_policy import ALLOW_PRIVATE_ENV
from jaxserve.sampling_params import SamplingParams
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import FakeCore, config
from tests.multimodal.test_media import Listener, MediaServer, data_url, image_bytes

# Renders each content part in order: an image part as LLaVA's marker ("openai" format).
PARTS_TEMPLATE = (
    "{% for m in messages %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}"
)
UNREACHABLE = "http://127.0.0.1:9/cat.png"  # the discard port: nothing listens


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the default model's: its chat template takes strings


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


def vision_config(limit: int = 2, path: str | None = None, model_type: str = "llava", domains=None):
    """A stand-in EngineConfig of a vision-language model (what the frontend reads of one)."""
    cfg = config(max_model_len=256)
    cfg.model.architecture = "LlavaForConditionalGeneration"
    cfg.model.hf_config = SimpleNamespace(
        multimodal_config={"model_type": model_type, "image_token_index": 0}
    )
    cfg.multimodal = MultiModalConfig({"image": limit}, path, domains)
    return cfg


def serve(tokenizer, cfg, requests: list, seen: list | None = None, **app_kwargs):
    """The responses of the app over a stand-in core to chat `requests` (bodies), sent
    concurrently. seen: collects each prompt's ids and images as they reach the model's
    image processing, which is skipped (the stand-in has no image processor): they run as
    text."""
    cfg.model.vocab_size = len(tokenizer)
    engine = AsyncLLM(cfg, FakeCore(), tokenizer=tokenizer)
    if seen is not None:  # the images reach the model's processing: recorded, not processed

        def record(ids, data, kwargs):
            seen.append({"prompt_token_ids": list(ids), "multi_modal_data": data})
            return ids, []

        engine.input_processor.process_multimodal = record
    app = build_app(engine, ["m"], log_stats_interval=None, **app_kwargs)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await asyncio.gather(*(
                client.post("/v1/chat/completions", json={"max_tokens": 1, **body})
                for body in requests
            ))  # fmt: skip

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)


def ask(*parts: str, **fields) -> dict:
    """A chat body of one user message whose content is `parts`: URLs (http, data:, file:)
    as image_url parts, other strings as text parts."""
    content = [
        {"type": "image_url", "image_url": {"url": p}}
        if p.startswith(("http", "data:", "file:"))
        else {"type": "text", "text": p}
        for p in parts
    ]
    return {"messages": [{"role": "user", "content": content}], **fields}


def error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"  # never an SSE stream
    return response.json()["error"]["message"]


# ---------------------------------------------------------------------- 400s
def test_too_many_images_is_a_400_before_any_is_fetched(tokenizer, media_server):
    img = f"{media_server.url}/img.png"
    split = {"messages": [ask(img, img, "and")["messages"][0], ask(img, "these?")["messages"][0]]}
    hits = len(media_server.hits)
    one, two = serve(tokenizer, vision_config(limit=2), [ask(img, img, img, "x"), split])
    for r in (one, two):  # images of every message count
        assert error(r) == (
            "At most 2 image(s) may be provided in one prompt. Set `--limit-mm-per-prompt` to "
            "increase this limit (got 3)."
        )
    assert len(media_server.hits) == hits


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_for_a_text_only_model_is_a_400(tokenizer, media_server, stream):
    hits = len(media_server.hits)
    (r,) = serve(tokenizer, config(), [ask(f"{media_server.url}/img.png", "hi", stream=stream)])
    message = error(r)
    assert message.startswith("At most 0 image(s) may be provided in one prompt.")
    assert "text-only model: it takes no images (multimodal inputs)" in message
    assert len(media_server.hits) == hits


def test_the_engines_own_refusal_of_images_is_a_400(tokenizer, media_server, monkeypatch):
    """Past the frontend's count check, the engine's ValueError for a text-only model
    (InputProcessor) is a 400 too."""
    monkeypatch.setattr(serving_chat, "check_image_count", lambda count, cfg: None)
    body = ask(f"{media_server.url}/img.png", "hi")
    (r,) = serve(tokenizer, config(), [body], chat_template=PARTS_TEMPLATE)
    message = error(r).lower()
    assert "image" in message or "multimodal" in message
    assert "marker" not in message  # the engine's refusal, not the template's


@pytest.mark.parametrize("stream", [False, True])
def test_an_unreachable_url_is_a_400_naming_it(tokenizer, stream, monkeypatch):
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
    (r,) = serve(tokenizer, vision_config(), [ask(UNREACHABLE, "hi", stream=stream)])
    assert error(r) == f"could not fetch image from URL {UNREACHABLE}"  # not why


@pytest.mark.parametrize("stream", [False, True])
def test_a_default_server_refuses_a_loopback_url_without_connecting(tokenizer, stream, monkeypatch):
    monkeypatch.delenv(ALLOW_PRIVATE_ENV, raising=False)
    listener = Listener()
    try:
        url = f"http://127.0.0.1:{listener.port}/x.png"
        (r,) = serve(tokenizer, vision_config(), [ask(url, "hi", stream=stream)])
        assert error(r) == (
            f"image URL {url} refused: its address 127.0.0.1 is not public (set "
            f"{ALLOW_PRIVATE_ENV}=1 to allow)"
        )
        assert listener.connections() == 0
    finally:
        listener.close()


def test_allowed_media_domains_hold_on_every_hop(tokenizer, media_server):
    port = media_server.port
    cfg = vision_config(domains=("localhost",))
    outside = f"http://127.0.0.1:{port}/img.png"
    to_outside = f"http://localhost:{port}/to?{outside}"
    seen: list = []
    hits = len(media_server.hits)
    ok, refused, redirected = serve(
        tokenizer, cfg, [ask(f"http://localhost:{port}/img.png"), ask(outside),
                         ask(to_outside)], seen,
    )  # fmt: skip
    assert ok.status_code == 200, ok.text
    assert seen[0]["multi_modal_data"]["image"][0].size == (8, 6)
    assert error(refused) == (
        f"image URL {outside} refused: its host '127.0.0.1' is not in --allowed-media-domains"
    )
    assert error(redirected) == (
        f"image URL {to_outside} refused (redirected to {outside}): its host '127.0.0.1' is "
        "not in --allowed-media-domains"
    )
    assert sorted(media_server.hits[hits:]) == ["/img.png", f"/to?{outside}"]


def test_payloads_that_are_no_images_are_400s(tokenizer, media_server):
    text = f"{media_server.url}/text"
    bodies = [ask(text, "hi"), ask(data_url(b"hello"), "hi"), ask(f"{media_server.url}/404.png"),
              ask("data:text/plain;base64,aGk=")]  # fmt: skip
    http_text, data, missing, plain = serve(tokenizer, vision_config(), bodies)
    assert error(http_text).startswith("image_url payload is not an image: not one of JPEG")
    assert text in error(http_text)
    assert "not an image" in error(data) and "data:image/png;base64,..." in error(data)
    assert error(missing).endswith("/404.png: HTTP status 404")
    assert "media type 'text/plain' is not an image type" in error(plain)


def test_local_files_need_the_allowed_path(tokenizer, tmp_path):
    (tmp_path / "cat.png").write_bytes(image_bytes())
    url = f"file://{tmp_path}/cat.png"
    (refused,) = serve(tokenizer, vision_config(), [ask(url, "hi")])
    assert error(refused).startswith("Cannot load local files without `--allowed-local-media-path`")
    seen = []
    (ok,) = serve(tokenizer, vision_config(path=str(tmp_path)), [ask(url, "hi")], seen)
    assert ok.status_code == 200, ok.text
    assert seen[0]["multi_modal_data"]["image"][0].size == (8, 6)
    (outside,) = serve(tokenizer, vision_config(path=str(tmp_path / "sub" / "..")),
                       [ask(f"file://{tmp_path}/../cat.png", "hi")])  # fmt: skip
    assert "must be a subpath of `--allowed-local-media-path`" in error(outside)


def test_an_image_over_max_image_bytes_is_a_400(tokenizer):
    (r,) = serve(tokenizer, vision_config(), [ask(data_url(image_bytes()), "hi")],
                 max_image_bytes=50)  # fmt: skip
    assert "is larger than 50 bytes" in error(r)


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "input_audio", "input_audio": {}}, "parts of type 'input_audio' are not"),
        ({"type": "image"}, "parts of type 'image' are not supported"),
        ({"type": "image_pil", "image_pil": "x"}, "parts of type 'image_pil' are not"),
        ({"type": "image_url", "image_url": {}}, "messages[0].content[0].image_url must be"),
        ({"type": "image_url", "image_url": {"url": 3}}, 'image_url must be {"url"'),
        ({"type": "refusal"}, "parts of type 'refusal' are not supported"),
        ({"text": "no type"}, "must be a text or image_url part"),
    ],
)
def test_malformed_or_unsupported_parts_are_400s(tokenizer, part, message):
    body = {"messages": [{"role": "user", "content": [part]}]}
    (r,) = serve(tokenizer, vision_config(), [body])
    assert message in error(r)


def test_a_string_template_with_an_unknown_image_marker_is_a_400(tokenizer):
    (r,) = serve(tokenizer, vision_config(model_type="newvlm"), [ask(data_url(image_bytes()))])
    assert "image marker is not known" in error(r)


# ---------------------------------------------------------------------- images reach the engine
def test_images_reach_the_engine_in_order_with_markers_in_the_prompt(tokenizer, media_server):
    """The default model's template takes content as one string: vLLM's form, the markers
    first, then the text; each request's images, fetched, in order."""
    seen: list = []
    untyped = ask(data_url(image_bytes()), f"{media_server.url}/img2.png", "What are these?")
    del untyped["messages"][0]["content"][1]["type"]  # vLLM takes an image part without one
    bodies = [untyped, ask("Just text", stream=True)]
    with_images, text_only = serve(tokenizer, vision_config(), bodies, seen)
    assert with_images.status_code == 200 and text_only.status_code == 200, with_images.text
    (prompt,) = seen  # the text-only request has no images to process
    text = tokenizer.decode(prompt["prompt_token_ids"])
    assert "<|im_start|>user\n<image>\n<image>\nWhat are these?<|im_end|>" in text
    assert [i.size for i in prompt["multi_modal_data"]["image"]] == [(8, 6), (16, 6)]
    assert all(i.mode == "RGB" for i in prompt["multi_modal_data"]["image"])


def test_a_template_over_parts_gets_image_parts_where_they_were(tokenizer, media_server):
    seen: list = []
    body = ask("Compare ", f"{media_server.url}/img.png", " with ", data_url(image_bytes()),
               stream=True)  # fmt: skip
    (r,) = serve(tokenizer, vision_config(), [body], seen, chat_template=PARTS_TEMPLATE)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert '"error"' not in r.text
    assert tokenizer.decode(seen[0]["prompt_token_ids"]) == "Compare <image> with <image>"
    assert len(seen[0]["multi_modal_data"]["image"]) == 2


def test_text_only_content_lists_still_work(tokenizer):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    body = {"messages": [{"role": "user", "content": parts}]}
    for cfg in (config(), vision_config()):
        (r,) = serve(tokenizer, cfg, [body])
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- LLM.chat
def test_llm_chat_takes_image_url_and_image_pil_parts(tokenizer, media_server, monkeypatch):
    from PIL import Image

    cfg = vision_config(limit=2)
    cfg.model.vocab_size = len(tokenizer)
    engine = LLMEngine(cfg, tokenizer=tokenizer, client=FakeCore())
    seen = []
    process_inputs = engine.process_inputs

    def recording(request_id, prompt, *args, **kwargs):
        seen.append(prompt)
        text_only = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        return process_inputs(request_id, text_only, *args, **kwargs)

    engine.process_inputs = recording
    llm = object.__new__(LLM)  # an LLM over the stand-in core
    llm.llm_engine, llm._counter = engine, itertools.count()
    pil = Image.new("RGB", (5, 5))
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": pil},
        {"type": "image_url", "image_url": {"url": f"{media_server.url}/img2.png"}},
        {"type": "text", "text": "Same?"}]}]  # fmt: skip
    (out,) = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.finished
    images = seen[0]["multi_modal_data"]["image"]
    assert images[0] is pil and images[1].size == (16, 6)
    assert "<image>\n<image>\nSame?" in seen[0]["prompt"]
    too_many = [{"role": "user", "content": [{"type": "image_pil", "image_pil": pil}] * 3}]
    with pytest.raises(ValueError, match="At most 2 image"):
        llm.chat(too_many, use_tqdm=False)
    with pytest.raises(ValueError, match="could not fetch image from URL"):
        llm.chat(ask(UNREACHABLE, "hi")["messages"], use_tqdm=False)
    # LLM.generate hands a prompt dict on as it is
    llm.generate({"prompt": "x", "multi_modal_data": {"image": [pil]}}, use_tqdm=False)
    assert seen[-1]["multi_modal_data"] == {"image": [pil]}


# ---------------------------------------------------------------------- templates, flags
def test_a_processors_chat_template_is_found_beside_the_model(tmp_path):
    assert model_chat_template(tmp_path, None) is None
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ json }}"}))
    assert model_chat_template(tmp_path) == "{{ json }}"
    (tmp_path / "chat_template.jinja").write_text("{{ jinja }}")
    assert model_chat_template("/nonexistent", tmp_path) == "{{ jinja }}"
    cfg = SimpleNamespace(tokenizer_path=None, model_path=str(tmp_path))
    assert default_chat_template(SimpleNamespace(chat_template=None), cfg) == "{{ jinja }}"
    assert default_chat_template(SimpleNamespace(chat_template="own"), cfg) is None


def test_the_flags_reach_engine_args_and_are_checked_early(tmp_path):
    args = parse_args(["serve", "--limit-mm-per-prompt", '{"image": 2}', "--max-image-bytes",
                       "1000", "--allowed-local-media-path", str(tmp_path),
                       "--allowed-media-domains", "a.example", "B.example"])  # fmt: skip
    check_server_args(args)
    engine_args = engine_args_from(args)
    assert engine_args.limit_mm_per_prompt == '{"image": 2}'
    assert engine_args.allowed_media_domains == ["a.example", "B.example"]
    assert parse_args(["serve"]).allowed_media_domains is None
    assert engine_args.allowed_local_media_path == str(tmp_path) and args.max_image_bytes == 1000
    assert parse_args(["serve"]).max_image_bytes == 20 * 1024 * 1024
    for flags, message in [
        (["--limit-mm-per-prompt", '{"audio": 1}'], "jaxserve takes no audio inputs"),
        (["--limit-mm-per-prompt", "{image: 1}"], "is not JSON"),
        (["--allowed-local-media-path", str(tmp_path / "no")], "does not exist"),
        (["--allowed-media-domains", "https://a.example"], "is not a host name"),
        (["--max-image-bytes", "0"], "--max-image-bytes must be positive, got 0"),
    ]:
        with pytest.raises(SystemExit, match=message):
            check_server_args(parse_args(["serve", *flags]))


def test_engine_args_build_the_multimodal_config(tmp_path):
    config = EngineArgs(limit_mm_per_prompt='{"image": 3}', allowed_local_media_path=str(tmp_path),
                        allowed_media_domains=["A.example"]).create_engine_config()  # fmt: skip
    assert config.multimodal == MultiModalConfig({"image": 3}, str(tmp_path), ("a.example",))
    assert EngineArgs().create_engine_config().multimodal.limit("image") == 999
    with pytest.raises(ValueError, match=r"limit_mm_per_prompt\['image'\] must be a non-negative"):
        EngineArgs(limit_mm_per_prompt={"image": -2}).create_engine_config()
    with pytest.raises(ValueError, match="'http://a.example' is not a host name"):
        EngineArgs(allowed_media_domains=["http://a.example"]).create_engine_config()
