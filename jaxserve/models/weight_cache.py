"""Converted weights on disk: a start that would dequantize a GGUF file again reads the arrays
it placed last time instead (~1-2 s of the default model's start-up on 2 cores).

One directory per (model file, conversion) under $JAXSERVE_WEIGHT_CACHE (default
~/.cache/jaxserve/weights; "0" turns the cache off), named by a hash of everything the
converted arrays depend on (`key`): the model file's name, size and modification time, the
jaxserve sources (they do the conversion), the model config (dtype, quantization, architecture)
and the KV-head replication of the tensor-parallel layout. Anything different is another
directory, so a stale array is never loaded; one that fails to read or does not match the
model's parameters is ignored (and deleted). Inside: `data.bin` (every array, C order, each
at a 64-byte aligned offset) and `index.json` (each parameter's path, dtype, shape and
offset), written to a temporary directory renamed into place; past KEEP_BYTES in all, the
least recently used go.

Only GGUF files are cached: their blocks are dequantized on every load, where a safetensors
checkpoint is read almost as it lies (a copy would double its disk use for little).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve import envs
from jaxserve.cache_keys import file_stats, source_digest

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the layout changes
KEEP_BYTES = 2 << 30  # the default model's float32 weights take 0.5 GiB
ALIGN = 64  # bytes: every array starts at a multiple


def cache_dir() -> Path | None:
    """$JAXSERVE_WEIGHT_CACHE, or ~/.cache/jaxserve/weights; None when it is "0"."""
    value = envs.JAXSERVE_WEIGHT_CACHE
    return None if value is None else Path(value)


def key(model_path: str | Path, config: Any, kv_replicas: int) -> str:
    """The directory name for the converted weights of `model_path` under `config` (a
    ModelConfig) and this KV-head replication."""
    digest = hashlib.sha256()
    for part in (FORMAT, file_stats(str(model_path)), source_digest(), repr(config), kv_replicas):
        digest.update(f"{part}\n".encode())
    return digest.hexdigest()[:32]


def read(name: str, targets: dict[tuple, Any]) -> dict[tuple, np.ndarray] | None:
    """The cached arrays of entry `name` (memory-mapped), or None when there is none or it does
    not hold exactly `targets`' parameters in their shapes and dtypes."""
    root = cache_dir()
    entry = root / name if root is not None else None
    if entry is None or not (entry / "index.json").exists():
        return None
    try:
        os.utime(entry)  # recently used: pruned last
        index = json.loads((entry / "index.json").read_text())
        data = np.memmap(entry / "data.bin", dtype=np.uint8, mode="r")
        arrays = {}
        for path, dtype, shape, offset in index:
            dtype, shape = jnp.dtype(dtype), tuple(shape)
            size = int(np.prod(shape)) * dtype.itemsize
            arrays[tuple(path)] = data[offset : offset + size].view(dtype).reshape(shape)
        if arrays.keys() != targets.keys() or any(
            a.shape != tuple(targets[p].shape) or a.dtype != jnp.dtype(targets[p].dtype)
            for p, a in arrays.items()
        ):
            raise ValueError("its parameters differ from the model's")
        return arrays
    except Exception as e:  # deleted: this load writes it again
        logger.warning("ignoring the weight cache %s (%s: %s)", entry, type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


class Writer:
    """Collects the arrays a load places, in order; `commit` makes them an entry."""

    def __init__(self, name: str):
        self.name = name
        self.root = cache_dir()
        self.tmp: Path | None = None
        self.index: list[list] = []
        self.offset = 0
        if self.root is not None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".tmp-"))
                self.data = open(self.tmp / "data.bin", "wb")  # noqa: SIM115 (commit closes)
            except OSError as e:
                logger.warning("weights will not be cached in %s: %s", self.root, e)
                self.tmp = None

    def add(self, path: tuple, array: np.ndarray) -> None:
        if self.tmp is None:
            return
        array = np.ascontiguousarray(array)
        pad = -self.offset % ALIGN
        self.data.write(b"\0" * pad)
        self.offset += pad
        self.index.append([list(path), array.dtype.name, list(array.shape), self.offset])
        self.data.write(array.reshape(-1).view(np.uint8))  # no copy
        self.offset += array.nbytes

    def abort(self) -> None:
        if self.tmp is not None:
            self.data.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def commit(self) -> None:
        if self.tmp is None:
            return
        try:
            self.data.close()
            (self.tmp / "index.json").write_text(json.dumps(self.index))
            os.replace(self.tmp, self.root / self.name)
            self.tmp = None
            _prune(self.root)
        except OSError as e:  # another process wrote the same entry first, a full disk
            logger.warning("could not cache the weights in %s: %s", self.root, e)
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


def _prune(root: Path, keep_bytes: int = KEEP_BYTES) -> None:
    """Delete the least recently used entries beyond `keep_bytes` in all (the newest stays)."""
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".tmp-")]
    entries.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    total = 0
    for i, entry in enumerate(entries):
        total += sum(f.stat().st_size for f in entry.iterdir())
        if i and total > keep_bytes:
            shutil.rmtree(entry, ignore_errors=True)
