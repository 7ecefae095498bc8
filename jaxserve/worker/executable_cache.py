"""Serialized step executables: a warm start loads them instead of tracing, lowering and
looking each one up in jax's persistent compilation cache (which still traces and lowers).

One file per runner under `<compile cache dir>/executables/`, named by a hash of everything an
executable depends on that tracing would otherwise decide (`signature`): the jaxserve and
pallas_kernels sources, jax and jaxlib versions, the backend's platform and version, the
devices and the mesh, XLA_FLAGS, the engine and model configuration, and the shape, dtype and
sharding of every argument array. Anything different is a different file, so a stale
executable is never loaded; a file that fails to load for any reason is ignored and the runner
compiles as before. Writes go to a temporary file renamed into place (concurrent starts are
safe); past KEEP_FILES files, the least recently used are deleted.

An executable that jax's persistent cache gave back (a hit) is saved as the bytes that cache
held: on XLA:CPU, serializing an executable that was itself deserialized loses its kernels
("Function ... not found" when it runs), so those bytes are taken as jax reads them
(`watch_cache_reads`); a hit whose bytes were not seen leaves no file.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import io
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxserve import cache_keys, envs

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the file layout changes


def environment() -> dict[str, str]:
    """What outside the engine's configuration decides an executable."""
    devices = jax.devices()
    return {
        "format": str(FORMAT),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": f"{devices[0].client.platform} {devices[0].client.platform_version}",
        "devices": ",".join(f"{d.id}:{d.device_kind}" for d in devices),
        "process": f"{jax.process_index()} of {jax.process_count()}",  # multi-host ranks
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x64": str(getattr(jax.config, "jax_enable_x64", None)),
        "matmul_precision": str(getattr(jax.config, "jax_default_matmul_precision", None)),
        "sources": cache_keys.source_digest(),
        # what picks a kernel as a step is traced: the forcing variables, and the kernel
        # library that is importable or not (an executable saved without tokamax is XLA's
        # ragged_dot, not to be loaded once tokamax is installed)
        "kernels": " ".join(
            str(k)
            for k in (
                envs.JAXSERVE_PALLAS_KERNEL,
                envs.JAXSERVE_MOE_KERNEL,
                envs.JAXSERVE_SPARSE_MLA_KERNEL,
            )
        ),
        "tokamax": _version("tokamax"),
    }


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def abstract(tree: Any) -> str:
    """Shape, dtype and sharding of every array in `tree`, with the tree's structure."""
    leaves, treedef = jax.tree.flatten(tree)
    described = [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]
    return f"{treedef}|{described}"


def signature(**parts: Any) -> str:
    """A file name for the executables that `parts` (the runner's configuration and argument
    layouts, as strings) and this process's environment decide."""
    digest = hashlib.sha256()
    for name, value in sorted({**environment(), **parts}.items()):
        digest.update(f"{name}={value}\n".encode())
    return digest.hexdigest()[:32]


KEEP_FILES = 16  # the most recently used saved files kept; older ones are deleted on save


_gc_lock = threading.Lock()
_gc_holders = 0  # threads inside no_gc now
_gc_was_enabled = False  # whether the collector ran before the first of them


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The garbage collector off, after one collection: what dropped engines left in reference
    cycles is freed now, not in a thread while another one is inside XLA compiling or loading
    (CI once died, SIGSEGV, with two threads inside XLA:CPU's deserialize_executable). Counted
    across threads: the collector comes back on when the last one leaves (not when the first
    does, while a second engine's start-up is still loading)."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            gc.collect()
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


def prune(directory: Path, keep: int = KEEP_FILES) -> None:
    """Delete all but the `keep` most recently used files (every code change or new flag set
    writes a new one)."""
    files = sorted(directory.glob("*.pkl"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for stale in files[keep:]:
        stale.unlink(missing_ok=True)


def _path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir) / "executables" / f"{key}.pkl"


def read(cache_dir: str, key: str) -> dict[tuple, Any] | None:
    """The executables saved under `key`, still serialized (`deserialize` loads them); None
    when there is no such file or it cannot be read (the caller compiles). A start stopped
    while compiling in the background has saved some of its shapes only."""
    path = _path(cache_dir, key)
    if not path.exists():
        return None
    try:
        os.utime(path)  # recently used: pruned last
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception as e:  # a truncated file, a jax that pickles differently: compile
        logger.warning("ignoring the saved executables in %s (%s: %s)", path, type(e).__name__, e)
        return None


def deserialize(
    saved: dict[tuple, Any], names: list[tuple], devices: Callable[[tuple], list], workers: int
) -> Iterator[tuple[tuple, Any]]:
    """(name, executable) for each of `names`, in order, loaded onto `devices(name)` from
    `saved` in `workers` threads: XLA:CPU links each 30-layer forward's kernels as it loads
    (~1 s each), and two threads halve that on 2 cores. Run it under `no_gc`."""

    def load(name: tuple) -> Any:
        blob, in_tree, out_tree = saved[name]
        on = devices(name)
        return serialize_executable.deserialize_and_load(
            blob, in_tree, out_tree, backend=on[0].client, execution_devices=on
        )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield from zip(names, pool.map(load, names), strict=True)


_NOT_SEEN = object()
_FRESH = object()  # a window's entry for an executable XLA compiled (not read from the cache)
_read_lock = threading.Lock()
# The open CacheHits' maps: id(executable) -> (executable, the bytes it was read from, _FRESH,
# or None where the bytes could not be taken).
_recording: list[dict[int, Any]] = []
_compiles_watched = False  # fresh compiles are recorded too (jax's internals allowed it)


class CacheHits:
    """While open, maps every executable XLA hands this process: id(executable) ->
    (executable, the serialized bytes a persistent-cache hit was read from, _FRESH for one
    compiled, or None where a hit's bytes could not be taken)."""

    def __enter__(self) -> dict[int, Any]:
        self.hits: dict[int, Any] = {}
        with _read_lock:
            _recording.append(self.hits)
        return self.hits

    def __exit__(self, *exc) -> None:
        with _read_lock:
            _recording.remove(self.hits)


def watch_cache_reads() -> None:
    """Wrap jax's persistent-cache read so that hits are deserialized one at a time (compile_all
    compiles in threads, and CI once died, SIGSEGV, with two threads inside XLA:CPU's
    deserialize_executable at once) and their bytes are kept for `save` while a CacheHits is
    open; and XLA's compile, so that `save` knows which executables it may serialize itself.
    A no-op where jax's internals differ (then any hit keeps `save` from writing)."""
    global _compiles_watched
    from jax._src import compilation_cache as cc
    from jax._src import compiler

    read = getattr(cc, "get_executable_and_time", None)
    if read is None or getattr(read, "_jaxserve_watched", False):
        return

    def watched_read(cache_key, compile_options, backend, *args, **kwargs):
        with _read_lock:
            executable, compile_time = read(cache_key, compile_options, backend, *args, **kwargs)
            if executable is not None and _recording:
                try:
                    raw = cc.decompress_executable(cc._get_cache(backend).get(cache_key))
                    blob = cc.extract_executable_and_time(raw)[0]
                except Exception as e:  # jax's internals moved: this hit cannot be saved
                    logger.debug("persistent-cache hit %s not kept: %r", cache_key, e)
                    blob = None
                for hits in _recording:
                    hits[id(executable)] = (executable, blob)  # keeps the id valid
            return executable, compile_time

    watched_read._jaxserve_watched = True
    cc.get_executable_and_time = watched_read
    _whole_cache_writes()

    compile_and_load = getattr(compiler, "backend_compile_and_load", None)
    if compile_and_load is not None:

        def watched_compile(*args, **kwargs):
            executable = compile_and_load(*args, **kwargs)
            with _read_lock:
                for hits in _recording:
                    hits[id(executable)] = (executable, _FRESH)
            return executable

        compiler.backend_compile_and_load = watched_compile
        _compiles_watched = True


def _whole_cache_writes() -> None:
    """Make jax's persistent-cache writes appear whole: without a size limit (its default) jax
    writes an entry in place, unlocked, so another process sharing the cache (the suite's two
    xdist workers, their engine subprocesses, data-parallel engines) could read a file still
    being written and hand XLA a partial executable (CI died, SIGSEGV, in the main thread's
    deserialize_executable under get_executable_and_time). Written beside the entry and renamed
    over it instead (a rename is atomic). A no-op where jax's internals differ, or with a size
    limit (jax locks then)."""
    try:
        from jax._src import lru_cache
    except ImportError:
        return
    put = getattr(getattr(lru_cache, "LRUCache", None), "put", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    is_local = getattr(lru_cache, "_is_local_filesystem", None)
    if None in (put, suffix, is_local) or getattr(put, "_jaxserve_whole", False):
        return

    def whole_put(self, key: str, value: bytes) -> None:
        directory = str(getattr(self, "path", "")).removeprefix("file://")
        if getattr(self, "eviction_enabled", True) or not key or not is_local(directory):
            return put(self, key, value)
        target = Path(directory) / f"{key}{suffix}"
        if target.exists():
            return None
        with tempfile.NamedTemporaryFile(
            dir=directory, prefix=".", suffix=".tmp", delete=False
        ) as f:
            f.write(value)
        os.chmod(f.name, 0o644)  # as jax's own write (a temporary file is the owner's alone)
        os.replace(f.name, target)
        return None

    whole_put._jaxserve_whole = True
    lru_cache.LRUCache.put = whole_put


def _serialize(compiled: Any, hits: dict[int, Any]) -> tuple[bytes, Any, Any]:
    """serialize_executable.serialize, writing a persistent-cache hit as the bytes it was read
    from (jax's own pickler otherwise; a jax without it raises, and save writes nothing).
    Raises for an executable this start neither compiled nor read (one jax's in-memory caches
    share with another engine in this process, which may have read it from the persistent
    cache): re-serializing a deserialized XLA:CPU executable writes one whose kernels are
    missing ("Function ... not found" in the process that loads it)."""
    # jax's serialize checks what its pickler cannot carry (const args, mutable refs); with hits
    # its bytes are discarded and the executable pickled again below (start-up only).
    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    if not hits and not _compiles_watched:
        return blob, in_tree, out_tree

    class HitBytesPickler(serialize_executable._JaxPjrtPickler):
        def persistent_id(self, obj):
            executable, raw = hits.get(id(obj), (_NOT_SEEN, None))
            if executable is obj and raw is not _FRESH:
                if raw is None:
                    raise ValueError("a persistent-cache hit whose bytes were not seen")
                return ("exec", raw)
            if (
                executable is not obj
                and _compiles_watched
                and isinstance(obj, serialize_executable.xc.LoadedExecutable)
            ):
                raise ValueError("an executable this start neither compiled nor read")
            return super().persistent_id(obj)

    unloaded = compiled._executable._unloaded_executable
    args_info_flat, _ = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as f:
        HitBytesPickler(f).dump((unloaded, args_info_flat, compiled._no_kwargs))
        return f.getvalue(), in_tree, out_tree


def save(
    cache_dir: str,
    key: str,
    compiled: dict[tuple, Any],
    hits: dict[int, Any] | None = None,
    serialized: dict[tuple, Any] | None = None,
) -> dict[tuple, Any]:
    """Write `compiled` under `key`, with `serialized` (entries of `read`'s dict, for the
    executables that were loaded: one loaded on XLA:CPU cannot be serialized again); hits: a
    CacheHits map open while they were compiled. Returns `compiled`'s entries as written. An
    executable this start neither compiled nor read is left out of the file; one jax cannot
    serialize at all leaves no file and returns {} (the next start compiles them, through
    jax's persistent cache)."""
    path = _path(cache_dir, key)
    written = {}
    for name, c in compiled.items():
        try:
            written[name] = _serialize(c, hits or {})
        except ValueError as e:  # left out: the next start compiles it (a cache hit)
            logger.info("not saving step %s: %s", name, e)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
            pickle.dump({**(serialized or {}), **written}, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(f.name, path)
        prune(path.parent)
        return written
    except Exception as e:
        logger.warning("could not save the executables to %s (%s: %s)", path, type(e).__name__, e)
        return {}
