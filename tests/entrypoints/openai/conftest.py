"""One `jaxserve serve` (API key KEY) shared by the modules of this package."""

import pytest

from tests.entrypoints.openai.test_api_server import KEY, Server
from tests.require import import_or_skip


@pytest.fixture(scope="package")
def server():
    s = Server("--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="package")
def client(server):
    openai = import_or_skip("openai")  # absent on the GPU machine (fails in CI: require.py)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
