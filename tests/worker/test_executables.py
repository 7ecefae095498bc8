"""The executable registry: every shape compiled (or loaded from an earlier start's file),
the urgent ones first and the rest in a background thread, looked up by name, and its
compile seam."""

import functools
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.worker.executables import (
    BACKGROUND_THREADS,
    ExecutableRegistry,
    num_compilations,
)

SIZES = (1, 2, 4, 8)


def lowerings() -> dict:
    double = jax.jit(lambda x: x * 2 + 1)
    return {("double", n): functools.partial(double.lower, jnp.zeros(n)) for n in SIZES}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_COMPILE_CACHE", str(tmp_path))
    return tmp_path


def devices():
    """Where each step shape runs: the first device."""
    return lambda name: jax.devices()[:1]


def test_every_shape_is_compiled_saved_and_loaded_by_the_next_start(cache_dir, caplog):
    first = ExecutableRegistry()
    first.compile_all(lowerings(), "key-a", devices())
    assert first.names() == {("double", n) for n in SIZES} and not first.missing()
    assert np.asarray(first["double", 4](jnp.ones(4))).tolist() == [3.0] * 4
    assert len(list((cache_dir / "executables").glob("*.pkl"))) == 1
    compiled = num_compilations()
    with caplog.at_level(logging.INFO, "jaxserve.worker.executables"):
        second = ExecutableRegistry()
        second.compile_all(lowerings(), "key-a", devices())
    assert f"loaded {len(SIZES)} step shapes" in caplog.text
    assert num_compilations() == compiled  # nothing compiled
    assert np.asarray(second["double", 2](jnp.ones(2))).tolist() == [3.0] * 2


def test_a_missing_shape_is_an_error_never_a_compile(cache_dir):
    registry = ExecutableRegistry()
    registry.compile_all(lowerings(), "key-b", devices())
    with pytest.raises(RuntimeError, match=r"no compiled step for \('double', 16\)"):
        registry["double", 16]
    assert ("double", 16) not in registry and ("double", 8) in registry


def test_urgent_shapes_first_the_rest_in_the_background_through_compile_fn(cache_dir):
    gate, compiled_by = threading.Event(), {}

    def held(name, lowered):  # the seam: background compiles wait for the gate
        compiled_by[name] = threading.current_thread().name.startswith(BACKGROUND_THREADS)
        if compiled_by[name]:
            assert gate.wait(60)
        return lowered.compile()

    registry = ExecutableRegistry(held)
    registry.compile_all(
        lowerings(), "key-c", devices(), urgent=lambda n: n[1] <= 2, order=lambda n: -n[1]
    )
    assert registry.compiling and registry.names() == {("double", 1), ("double", 2)}
    assert registry.missing() == {("double", 4), ("double", 8)}
    gate.set()
    assert registry.wait(60) and not registry.missing()
    assert {n for n, background in compiled_by.items() if background} == {
        ("double", 4), ("double", 8),
    }  # fmt: skip
