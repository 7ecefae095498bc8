"""The garbage collector in a serving process. What start-up builds (modules, the model and
its compiled steps, the tokenizer) lives as long as the engine, and a full collection walks
all of it: ~170 ms for the ~340k objects of an engine beside jax and transformers, once every
few hundred steps at 256 sequences (a full pass runs when the objects that survived since the
last one reach a quarter of the old ones: every new request's). So each engine freezes the
heap (`gc.freeze`: out of every collection) once it has started, and the last one to shut
down unfreezes it (its garbage in cycles is collected again)."""

from __future__ import annotations

import gc

_engines = 0  # engines alive in this process that froze the heap


def freeze_heap(collect: bool = False) -> None:
    """Freeze what exists now; collect first (a process that runs one engine for its life,
    e.g. the engine core's): frozen garbage in cycles is freed only at unfreeze_heap."""
    global _engines
    if collect:
        gc.collect()
    gc.freeze()
    _engines += 1


def unfreeze_heap() -> None:
    """An engine that froze the heap has shut down; the last one unfreezes it."""
    global _engines
    _engines = max(0, _engines - 1)
    if _engines == 0:
        gc.unfreeze()
