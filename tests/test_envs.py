"""jaxserve/envs.py: each JAXSERVE_* variable's default and override, read when accessed, and
docs/environment_variables.md's table naming every one of them."""

import re
from pathlib import Path

import pytest

import jaxserve.envs as envs

ROOT = Path(__file__).parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    return monkeypatch


def test_defaults(clean_env):
    assert envs.JAXSERVE_ENABLE_MULTIPROCESSING is True
    assert envs.JAXSERVE_LOG_LEVEL == "INFO"
    assert envs.JAXSERVE_SHUTDOWN_TIMEOUT == 30.0
    assert envs.JAXSERVE_API_KEY is None
    assert envs.JAXSERVE_LOG_STATS_INTERVAL == 10.0
    assert envs.JAXSERVE_COMPILE_CACHE == "/home/u/.cache/jaxserve/xla"
    assert envs.JAXSERVE_WEIGHT_CACHE == "/home/u/.cache/jaxserve/weights"
    assert envs.JAXSERVE_KERNEL_CACHE == "/home/u/.cache/jaxserve/kernels"
    assert envs.JAXSERVE_SIMULATED_STEP is None
    assert envs.JAXSERVE_VLLM_PYTHON == ".venv-vllm/bin/python"
    assert envs.JAXSERVE_TEST_FAIL_AFTER_STEPS == -1
    assert envs.JAXSERVE_TEST_STEP_DELAY_S == 0.0


def test_overrides_are_read_when_accessed(clean_env):
    clean_env.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    clean_env.setenv("JAXSERVE_SHUTDOWN_TIMEOUT", "2.5")
    clean_env.setenv("JAXSERVE_TEST_FAIL_AFTER_STEPS", "3")
    clean_env.setenv("JAXSERVE_API_KEY", "k")
    clean_env.setenv("JAXSERVE_COMPILE_CACHE", "/tmp/xla")
    assert envs.JAXSERVE_ENABLE_MULTIPROCESSING is False
    assert envs.JAXSERVE_SHUTDOWN_TIMEOUT == 2.5
    assert envs.JAXSERVE_TEST_FAIL_AFTER_STEPS == 3
    assert envs.JAXSERVE_API_KEY == "k"
    assert envs.JAXSERVE_COMPILE_CACHE == "/tmp/xla"
    clean_env.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "1")
    assert envs.JAXSERVE_ENABLE_MULTIPROCESSING is True


def test_weight_cache_off_with_zero(clean_env):
    clean_env.setenv("JAXSERVE_WEIGHT_CACHE", "0")
    assert envs.JAXSERVE_WEIGHT_CACHE is None
    clean_env.setenv("JAXSERVE_WEIGHT_CACHE", "")  # empty: the default
    assert envs.JAXSERVE_WEIGHT_CACHE == "/home/u/.cache/jaxserve/weights"
    clean_env.setenv("JAXSERVE_WEIGHT_CACHE", "/w")
    assert envs.JAXSERVE_WEIGHT_CACHE == "/w"


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="JAXSERVE_NOPE"):
        envs.JAXSERVE_NOPE  # noqa: B018
    assert sorted(dir(envs)) == sorted(envs.environment_variables)


def test_docs_table_lists_every_variable():
    text = (ROOT / "docs" / "environment_variables.md").read_text()
    documented = re.findall(r"^\| `(JAXSERVE_[A-Z0-9_]+)` \|", text, re.MULTILINE)
    assert sorted(documented) == sorted(envs.environment_variables)


def test_every_variable_the_code_names_is_in_envs():
    """A JAXSERVE_* name in jaxserve/ or pallas_kernels/ is one envs.py defines (and so one
    the docs table has)."""
    named = set()
    for package in ("jaxserve", "pallas_kernels"):
        for path in (ROOT / package).rglob("*.py"):
            named |= set(re.findall(r"JAXSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert named <= set(envs.environment_variables), named - set(envs.environment_variables)
