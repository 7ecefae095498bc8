"""Skips that a broken install would also cause (no C++ compiler for the CPU attention
kernel, a test package such as `openai` missing) become failures when
JAXSERVE_TEST_REQUIRE_ALL=1, as CI sets it: there, a test that cannot run is a broken install,
not a reason to pass. Skips for missing hardware (`gpu`-marked tests, too few devices) are not
these: they skip either way."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

import jaxserve.envs as envs


def require_or_skip(reason: str | None) -> None:
    """Skip the calling test (or module, at import) for `reason`; fail instead when
    JAXSERVE_TEST_REQUIRE_ALL is set. None: nothing is missing, carry on."""
    if reason is None:
        return
    if envs.JAXSERVE_TEST_REQUIRE_ALL:
        pytest.fail(f"{reason} (JAXSERVE_TEST_REQUIRE_ALL=1: every test must run)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def import_or_skip(name: str) -> ModuleType:
    """`pytest.importorskip(name)`, failing instead under JAXSERVE_TEST_REQUIRE_ALL."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        require_or_skip(f"could not import {name!r}: {e}")
        raise  # not reached: require_or_skip skips or fails
