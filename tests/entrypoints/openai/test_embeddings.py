"""/v1/embeddings on `jaxserve serve --runner pooling`: the HF model's pooled hidden states,
float or base64, every input form, usage; bad requests fail alone with a 400 naming the value,
and the generation APIs are refused on a pooling server."""

import base64
import time

import httpx
import numpy as np
import pytest
import torch

from tests.entrypoints.openai.test_api_server import Server
from tests.helpers import make_tiny_hf

PROMPTS = [list(range(3, 8)), list(range(20, 43)), [9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(str(model_dir), "--task", "embed", "--pooler-config", '{"pooling_type": "MEAN"}',
               "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", "64",
               "--dtype", "float32", defaults=[])  # fmt: skip
    yield s
    s.stop()


def post(server, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_embeddings_are_hfs_mean_pooled_states(server, model_dir):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    r = post(server, {"input": PROMPTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == str(model_dir)
    assert body["usage"] == {"prompt_tokens": 29, "completion_tokens": 0, "total_tokens": 29}
    for item, prompt in zip(body["data"], PROMPTS, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).last_hidden_state[0].mean(0).numpy()
        got = np.array(item["embedding"])
        assert item["object"] == "embedding" and got.shape == want.shape
        assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) > 0.999
    one = post(server, {"input": PROMPTS[1], "encoding_format": "base64", "dimensions": 8})
    decoded = np.frombuffer(base64.b64decode(one.json()["data"][0]["embedding"]), "<f4")
    short = np.array(body["data"][1]["embedding"][:8])
    np.testing.assert_allclose(decoded, short / np.linalg.norm(short), rtol=1e-5)


@pytest.mark.parametrize(
    ("body", "path", "message"),
    [
        ({"input": []}, "/v1/embeddings", "input must not be empty"),
        ({"input": [1, 2], "encoding_format": "hex"}, "/v1/embeddings", "'hex'"),
        ({"input": [1, 2], "dimensions": 0}, "/v1/embeddings", "dimensions=0"),
        ({"input": list(range(1, 101))}, "/v1/embeddings", "100"),
        ({"prompt": [1, 2]}, "/v1/completions", "does not support the Completions API"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions",
         "does not support the Chat Completions API"),
    ],
)  # fmt: skip
def test_bad_requests_fail_alone(server, body, path, message):
    r = post(server, body, path)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert post(server, {"input": [5, 6, 7]}).status_code == 200  # still serving
    deadline = time.monotonic() + 10
    while server.metric("kv_cache_usage_perc") != 0.0:  # nothing left holding blocks
        assert time.monotonic() < deadline
        time.sleep(0.1)
