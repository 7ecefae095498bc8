"""A vLLM deployment moved to jaxserve unchanged: its launch line (vLLM's flags and spellings)
and its environment (VLLM_API_KEY) start the server, which then requires the key and answers
under --root-path as well as at the root, through the official openai client."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.test_api_server import MODEL, Server
from tests.require import import_or_skip

openai = import_or_skip("openai")

pytestmark = pytest.mark.slow

VLLM_KEY = "vllm-key"
LAUNCH = ["--enforce-eager", "--enable-chunked-prefill", "--max_model_len", "2048",
          "--root-path", "/llm"]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_server(tiny_model):
    defaults = ["--served-model-name", MODEL, "--max-num-seqs", "8"]
    env = {"VLLM_API_KEY": VLLM_KEY, "JAXSERVE_API_KEY": ""}
    server = Server(*tiny_model, *LAUNCH, env=env, defaults=defaults)
    yield server
    server.stop()


def client(server, path: str, key: str):
    return openai.OpenAI(base_url=f"{server.url}{path}", api_key=key, max_retries=0)


@pytest.mark.parametrize("path", ["/llm/v1", "/v1"])
def test_the_launch_line_requires_vllm_api_key_and_answers_under_the_root_path(vllm_server, path):
    with pytest.raises(openai.AuthenticationError):
        client(vllm_server, path, "wrong").models.list()
    keyed = client(vllm_server, path, VLLM_KEY)
    model = keyed.models.list().data[0]
    assert model.id == MODEL and model.max_model_len == 2048
    out = keyed.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    assert httpx.get(f"{vllm_server.url}{path.removesuffix('/v1')}/health").status_code == 200


def test_the_start_up_log_names_the_vllm_flags_that_do_nothing(vllm_server):
    log = vllm_server.tail(400)
    assert "--enforce-eager has no effect in jaxserve: CUDA graphs" in log
    assert "--enable-chunked-prefill has no effect in jaxserve: chunked prefill is always" in log
