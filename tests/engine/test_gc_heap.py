"""The heap an engine starts with is frozen out of the garbage collector's passes while any
engine of the process lives; the last one's shutdown gives it back."""

import gc

import pytest

from jaxserve.engine import gc_heap
from jaxserve.engine.gc_heap import freeze_heap, unfreeze_heap


@pytest.fixture(autouse=True)
def no_engines(monkeypatch):
    """The count of this process's engines at 0 (other tests' may be alive), then back."""
    alive = gc_heap._engines
    monkeypatch.setattr(gc_heap, "_engines", 0)
    gc.unfreeze()
    yield
    if alive:
        gc.freeze()


def test_the_heap_stays_frozen_until_the_last_engine_shuts_down():
    cycle = []
    cycle.append(cycle)  # start-up garbage in a cycle
    freeze_heap()
    freeze_heap()  # a second engine in the process
    assert gc.get_freeze_count() > 0
    unfreeze_heap()
    assert gc.get_freeze_count() > 0  # one engine still serves
    unfreeze_heap()
    assert gc.get_freeze_count() == 0
    unfreeze_heap()  # an extra shutdown changes nothing
    assert gc.get_freeze_count() == 0


def test_collecting_first_frees_the_garbage_before_freezing():
    cycle = []
    cycle.append(cycle)
    del cycle
    before = gc.get_freeze_count()
    freeze_heap(collect=True)
    try:
        assert gc.get_freeze_count() > 0 and gc.collect() == 0
    finally:
        unfreeze_heap()
    assert before == 0
