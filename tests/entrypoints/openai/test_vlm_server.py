"""Images through `jaxserve serve` on a tiny Qwen2.5-VL model: a chat request with one image
as a data URL and one fetched from a local HTTP server gives HF `generate`'s greedy tokens on
the same images and the prompt its chat template renders. (One family: the server's path is
the same for each; every family's chat template over image parts, through the renderer the
server uses, against HF: LLM.chat in tests/models/test_vlm.py.)"""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from PIL import Image

from jaxserve.multimodal.url_policy import ALLOW_PRIVATE_ENV
from tests.entrypoints.openai.test_api_server import Server
from tests.models.test_vlm import Family
from tests.multimodal.test_media import data_url
from tests.multimodal.tiny_vlm import draw_image

FLAGS = ["--served-model-name", "vlm", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--max-model-len", "512", "--num-gpu-blocks-override", "96"]  # fmt: skip
MAX_TOKENS = 8


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


IMAGES = {"/a.png": png(draw_image(11, 70, 50)), "/b.png": png(draw_image(12, 40, 90))}


@pytest.fixture(scope="module")
def media_url():
    """A local HTTP server of IMAGES; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = IMAGES.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    family = Family("qwen", tmp_path_factory)
    # media_url is a loopback server: image URLs to it allowed
    server = Server(str(family.dir), defaults=FLAGS, env={ALLOW_PRIVATE_ENV: "1"})
    yield family, server
    server.stop()


def test_chat_with_images_equals_hf_generate(served, media_url):
    family, server = served
    content = [
        {"type": "text", "text": "USER: "},
        {"type": "image_url", "image_url": {"url": data_url(IMAGES["/a.png"])}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": f"{media_url}/b.png"}},
        {"type": "text", "text": " differ? ASSISTANT:"},
    ]
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    got = [int(t["token"].removeprefix("token_id:"))
           for t in response.json()["choices"][0]["logprobs"]["content"]]  # fmt: skip

    template = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = family.tokenizer.apply_chat_template(
        [{"role": "user", "content": template}], tokenize=False, add_generation_prompt=True
    )
    images = [Image.open(io.BytesIO(IMAGES[p])) for p in ("/a.png", "/b.png")]
    inputs = family.hf_inputs(text, images)
    with torch.no_grad():
        gen = family.hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert got == gen[0, inputs["input_ids"].shape[1] :].tolist()
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == inputs["input_ids"].shape[1]  # the images' tokens counted


def test_a_prompt_too_long_once_its_images_expand_is_a_400_for_a_stream_too(served):
    """The images are processed before the response starts: a prompt that fits
    max_model_len as text but not with its images' tokens is a 400, streaming or not."""
    _, server = served
    content = [{"type": "image_url", "image_url": {"url": data_url(IMAGES["/a.png"])}},
               {"type": "text", "text": "x" * 490}]  # fmt: skip
    for stream in (False, True):
        body = {"model": "vlm", "messages": [{"role": "user", "content": content}],
                "max_tokens": 4, "stream": stream}  # fmt: skip
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert "maximum context length is 512 tokens" in response.json()["error"]["message"]


def test_a_named_tool_call_with_an_image(served):
    """A named tool_choice on an image prompt: the call's arguments follow the tool's schema
    (the constraint runs over the image's prompt like any other). 200 tokens: a random model
    may fill each of the object's 5 whitespace gaps up to the grammar's 24."""
    _, server = served
    tool = {"type": "function", "function": {
        "name": "describe", "parameters": {"type": "object", "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]}},
            "required": ["color"], "additionalProperties": False}}}  # fmt: skip
    content = [{"type": "image_url", "image_url": {"url": data_url(IMAGES["/a.png"])}},
               {"type": "text", "text": "Which color?"}]  # fmt: skip
    choice = {"type": "function", "function": {"name": "describe"}}
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}], "tools": [tool],
            "tool_choice": choice, "max_tokens": 200, "temperature": 0}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["function"]["name"] == "describe"
        args = call["function"]["arguments"]
        assert json.loads(args)["color"] in ("red", "green", "blue"), repr(args)
