"""One `jaxserve serve` (API key KEY) shared by the modules of this package."""

import pytest

from tests.entrypoints.openai.test_api_server import KEY, Server


@pytest.fixture(scope="package")
def server():
    s = Server("--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="package")
def client(server):
    openai = pytest.importorskip("openai")  # absent on the GPU machine
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
