"""The heap an engine starts with is frozen out of the garbage collector's passes while any
engine of the process lives; the last one's shutdown gives it back."""

import gc
import weakref

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
    freeze_heap()
    freeze_heap()  # a second engine in the process
    assert gc.get_freeze_count() > 0
    unfreeze_heap()
    assert gc.get_freeze_count() > 0  # one engine still serves
    unfreeze_heap()
    assert gc.get_freeze_count() == 0
    unfreeze_heap()  # an extra shutdown changes nothing
    assert gc.get_freeze_count() == 0


class Node:
    pass


@pytest.mark.parametrize("collect", [True, False])
def test_collecting_first_frees_the_garbage_before_freezing(collect):
    """Garbage in a cycle at start-up: collected before the freeze, or frozen with the heap
    (and freed once the last engine unfreezes it)."""
    gc.disable()  # no automatic pass between the garbage and the freeze
    node = Node()
    node.self = node
    alive = weakref.ref(node)
    del node
    freeze_heap(collect=collect)
    gc.enable()
    try:
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert (alive() is None) is collect
    finally:
        unfreeze_heap()
    gc.collect()
    assert alive() is None
