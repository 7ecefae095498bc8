"""One `jaxserve serve` (API key KEY) shared by the modules of this package, and the flags of a
tiny model for the tests of process behaviour.

Session-scoped, not package-scoped: xdist's workers run this package's files between other
packages' files (tests/schedule.py, longest first), and pytest tears a package's fixtures down
on leaving the package, so a package-scoped server started again for each file that used it
(~25 s of default-model start-up each, eight files). Now a worker starts it once, for the first
file that asks, and stops it when the session ends."""

import pytest

from tests.entrypoints.openai.test_api_server import KEY, Server
from tests.require import import_or_skip


@pytest.fixture(scope="session")
def server():
    s = Server("--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    openai = import_or_skip("openai")  # absent on the GPU machine (fails in CI: require.py)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> list[str]:
    """Flags serving a 2-layer random model with the default model's vocabulary and tokenizer,
    for behaviours of the processes that any model shows (engine death, SIGTERM drain, data
    parallel), at a fraction of the default model's start-up (with TINY_ENV, its steps take
    ~20 ms)."""
    from jaxserve.transformers_utils.model_path import default_model_path
    from tests.helpers import make_tiny_hf

    model = make_tiny_hf("llama", tmp_path_factory.mktemp("tiny"), vocab_size=49152,
                         num_hidden_layers=2, max_position_embeddings=2048)  # fmt: skip
    return [str(model), "--tokenizer", str(default_model_path())]
