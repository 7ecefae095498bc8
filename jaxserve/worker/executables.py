"""The executable registry: every step shape's compiled executable, made at start-up so that no
serving step ever compiles (a missing one is a bug, never a compile).

`compile_all` takes each shape's lowering (name -> a function returning `jax.stages.Lowered`):
loaded as saved by an earlier start with the same signature (worker/executable_cache.py), or
lowered and compiled in parallel threads (XLA compiles outside the GIL), then saved. With
`urgent`, it returns once those shapes are in and loads or compiles the rest in a background
thread named `compile`, each usable as soon as it is ready.

The seams for tests and tools: a runner takes its registry (ModelRunner(executables=...),
build_runner(executables=...)); `compile_fn(name, lowered) -> executable` replaces
`lowered.compile()` (to hold a compile back, or make no device program; it runs in worker
threads, named BACKGROUND_THREADS + "_N" for the shapes compiled in the background), and a
subclass may watch lookups (`__getitem__`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from jaxserve import envs
from jaxserve.worker import executable_cache

logger = logging.getLogger(__name__)

Lowering = Callable[[], Any]  # () -> jax.stages.Lowered
CompileFn = Callable[[tuple, Any], Any]  # (name, jax.stages.Lowered) -> executable
BACKGROUND_THREADS = "compile-background"  # the name prefix of the background compile threads


def compile_lowered(name: tuple, lowered: Any) -> Any:
    """The default compile_fn: compile with XLA."""
    return lowered.compile()


def compile_cache_dir() -> str:
    """$JAXSERVE_COMPILE_CACHE, or ~/.cache/jaxserve/xla: jax's persistent compilation cache,
    and the saved executables under its `executables/`."""
    return envs.JAXSERVE_COMPILE_CACHE


def enable_persistent_compilation_cache() -> None:
    jax.config.update("jax_compilation_cache_dir", compile_cache_dir())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    executable_cache.watch_cache_reads()
    _CompileCounter.listen()


class _CompileCounter:
    """Every compilation this process asks XLA for (persistent-cache hits included): serving
    must not add one. A jax.monitoring listener, registered on first use."""

    count = 0
    _registered = False
    _lock = threading.Lock()

    @classmethod
    def listen(cls) -> None:
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_listener(cls._event)
                cls._registered = True

    @classmethod
    def _event(cls, event: str, **_) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            cls.count += 1


def num_compilations() -> int:
    """Compilations requested in this process since the count began (the first call of this
    or of enable_persistent_compilation_cache; the persistent cache must be on)."""
    _CompileCounter.listen()
    return _CompileCounter.count


class ExecutableRegistry:
    def __init__(self, compile_fn: CompileFn | None = None):
        self.compile_fn = compile_fn or compile_lowered
        self.key = ""  # the saved file's name (compile_all's signature)
        self._compiled: dict[tuple, Any] = {}
        self._names: frozenset[tuple] = frozenset()  # every shape compile_all was given
        self._background: threading.Thread | None = None

    def __getitem__(self, name: tuple) -> Any:
        try:
            return self._compiled[name]
        except KeyError:
            raise RuntimeError(
                f"no compiled step for {name}: compile_all() must cover it"
            ) from None

    def __contains__(self, name: tuple) -> bool:
        return name in self._compiled

    def names(self) -> frozenset[tuple]:
        """The shapes ready now."""
        return frozenset(self._compiled)

    def items(self) -> list[tuple[tuple, Any]]:
        return list(self._compiled.items())

    def missing(self) -> set[tuple]:
        """The shapes compile_all was given that are not ready yet."""
        return set(self._names) - self._compiled.keys()

    @property
    def compiling(self) -> bool:
        """Whether the background thread is still loading or compiling shapes."""
        return self._background is not None and self._background.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background shapes; whether all are ready."""
        if self._background is not None:
            self._background.join(timeout)
        return not self.compiling

    def compile_all(
        self,
        lowerings: dict[tuple, Lowering],
        key: str,
        devices: Callable[[tuple], list],
        urgent: Callable[[tuple], bool] | None = None,
        order: Callable[[tuple], Any] | None = None,
    ) -> None:
        """Make every shape of `lowerings` ready; key: the signature its saved file goes under.
        urgent: the shapes to wait for (None: all); the others follow in a background thread
        on one core, in `order` (a sort key), and everything is saved once all are in (what
        is ready is saved first: a stopped start keeps it)."""
        start = time.perf_counter()
        self.key, self._names = key, frozenset(lowerings)
        cache_dir = compile_cache_dir()
        saved = executable_cache.read(cache_dir, key) or {}
        if not saved.keys() <= lowerings.keys():
            logger.warning("ignoring saved executables of other step shapes (key %s)", key)
            saved = {}
        loaded: set[tuple] = set()  # names loaded from the file
        now = [n for n in lowerings if urgent is None or urgent(n)]
        later = sorted((n for n in lowerings if n not in set(now)), key=order)
        hits = contextlib.ExitStack()  # persistent-cache hits, for save; open until all are in
        hit_bytes = hits.enter_context(executable_cache.CacheHits())

        def build(names: Iterable[tuple], workers: int, threads: str = "compile") -> None:
            nonlocal saved
            with executable_cache.no_gc():
                try:
                    on_file = [n for n in names if n in saved]
                    for name, exe in executable_cache.deserialize(saved, on_file, devices, workers):
                        self._compiled[name] = exe
                        loaded.add(name)
                except Exception as e:  # a jax that loads differently: compile the rest
                    logger.warning("could not load saved executables (%r); compiling", e)
                    saved = {n: saved[n] for n in loaded}
                with ThreadPoolExecutor(workers, thread_name_prefix=threads) as pool:
                    # Each compile starts as soon as its shape is lowered (here, holding the
                    # GIL), so lowering the next ones overlaps the compiles.
                    compiling = {
                        n: pool.submit(self.compile_fn, n, lowerings[n]())
                        for n in names
                        if n not in loaded
                    }
                    for name, future in compiling.items():
                        self._compiled[name] = future.result()

        def save() -> None:  # `saved`: the serialized bytes known good, of any shape
            compiled = {n: e for n, e in list(self._compiled.items()) if n not in saved}
            if compiled:
                saved.update(executable_cache.save(cache_dir, key, compiled, hit_bytes, saved))

        def finish() -> None:
            try:
                if later:  # what a stopped start compiled is kept
                    save()
                    build(later, 1, BACKGROUND_THREADS)  # a core left to the serving steps
                save()
                if later:
                    logger.info(
                        "%d more step shapes ready (and saved) in the background, %.1f s "
                        "after start-up began compiling",
                        len(later),
                        time.perf_counter() - start,
                    )
            finally:
                hits.close()

        build(now, workers=os.cpu_count() or 1)
        logger.info(
            "%s %d step shapes in %.1f s%s",
            "loaded" if loaded.issuperset(now) else "compiled",
            len(now),
            time.perf_counter() - start,
            f" ({len(later)} more in the background)" if later else "",
        )
        if later:
            self._background = threading.Thread(target=finish, daemon=True, name="compile")
            self._background.start()
        else:
            finish()
