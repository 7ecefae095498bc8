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


def test_a_dropped_engine_is_freed_while_another_keeps_the_heap_frozen(tmp_path, monkeypatch):
    """An engine holds no reference cycle (its core, runner and scheduler go as soon as the
    last reference does): with the heap frozen by another engine, a cycle would keep its
    weights and KV cache until every engine of the process has shut down."""
    from jaxserve.entrypoints.llm import LLM
    from tests.helpers import core_of, make_tiny_hf

    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    path = str(make_tiny_hf("llama", tmp_path / "llama"))
    args = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
    keep = LLM(path, **args)  # freezes the heap for as long as it lives
    llm = LLM(path, **args)
    core = core_of(llm)
    refs = [weakref.ref(x) for x in (core, core.runner, core.scheduler, core.control)]
    del core, llm
    assert [r() is None for r in refs] == [True] * 4
    del keep
