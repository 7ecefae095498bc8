"""`jaxserve collect-env` (vLLM's `vllm collect-env`): the report's main lines, on any machine."""

from __future__ import annotations

import platform

import jax

from jaxserve.entrypoints.cli import main
from jaxserve.version import __version__


def test_collect_env_reports_versions_devices_and_settings(capsys, monkeypatch):
    monkeypatch.setenv("JAXSERVE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("JAXSERVE_API_KEY", "secret")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    assert main(["collect-env"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
             for line in out.splitlines() if " : " in line}  # fmt: skip
    assert lines["jaxserve"] == __version__ and lines["jax"] == jax.__version__
    for name in ("jaxlib", "flax", "transformers", "tokenizers", "torch", "numpy"):
        assert lines[name][0].isdigit(), (name, lines[name])
    assert lines["Python"].startswith(platform.python_version())
    assert lines["JAX backend"] == jax.default_backend()
    assert lines["JAX devices"].startswith(f"{len(jax.devices())} ")
    assert "logical" in lines["CPU cores"] and lines["CPU"] and lines["OS"]
    assert "=== NVIDIA ===" in out  # nvidia-smi's report, or that there is none
    env = out.split("=== Environment variables ===")[1].split()
    assert {"JAXSERVE_LOG_LEVEL=DEBUG", "JAXSERVE_API_KEY=***", "CUDA_VISIBLE_DEVICES=0"} <= set(
        env
    )
    assert not any(e.startswith("UNRELATED_SETTING") for e in env)
