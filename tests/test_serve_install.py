"""The README's first command works in the environment users get: a serve-only venv (no test
extra, so no torch) built by `scripts/setup.sh --no-test`, `jaxserve serve` on the default model,
and the README's curl request answered."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.test_api_server import MODEL as SERVED_NAME
from tests.entrypoints.openai.test_api_server import SERVER_FLAGS, Server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-serve"  # its own venv: the test venv has torch


def readme_request() -> tuple[str, dict]:
    """The path and JSON body of the README's curl example."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"curl http://localhost:8000(\S+) .*?-d '(.*?)'", readme, re.S)
    assert m, "README.md has no curl example"
    return m.group(1), json.loads(m.group(2))


@pytest.fixture(scope="module")
def serve_venv() -> Path:
    # No bytecode pass over the whole venv (~14 s of CPU beside the other test worker): its
    # two server processes compile only what they import.
    env = {**os.environ, "JAXSERVE_VENV": str(VENV), "JAXSERVE_SETUP_COMPILE": "0"}
    setup = subprocess.run(
        ["bash", "scripts/setup.sh", "--no-test"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=1200,
    )  # fmt: skip
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    return VENV


def test_serve_only_install_has_no_torch(serve_venv):
    run = subprocess.run(
        [serve_venv / "bin" / "python", "-c", "import torch"], capture_output=True, text=True
    )
    assert run.returncode != 0 and "No module named 'torch'" in run.stderr


def test_readme_serve_command_answers_the_readme_request(serve_venv):
    path, body = readme_request()
    # The README's command; smaller engine sizes (the API server tests' ones, so their
    # compiled steps are in the persistent cache) keep start-up short.
    sizes = [f for f in SERVER_FLAGS if f not in ("--served-model-name", SERVED_NAME)]
    server = Server(command=[str(serve_venv / "bin" / "jaxserve")], defaults=sizes, timeout=600)
    try:
        response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        assert response.status_code == 200, f"{response.text}\n{server.tail()}"
        answer = response.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, f"{answer!r}\n{server.tail()}"
    finally:
        server.stop()
