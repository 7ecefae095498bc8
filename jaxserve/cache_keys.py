"""What a file cache's key covers beyond the configuration: the code that made the cached
thing and the files it was made from. The step-executable cache (worker/executable_cache.py)
and the converted-weight cache (models/weight_cache.py) both key on these."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path


@functools.cache
def source_digest() -> str:
    """sha256 over every .py and .cc file of jaxserve and pallas_kernels (their code is traced
    into the executables, or called by them); found without importing either package."""
    digest = hashlib.sha256()
    for package in ("jaxserve", "pallas_kernels"):
        root = Path(importlib.util.find_spec(package).origin).parent
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.cc")]):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def file_stats(path: str) -> str:
    """Name, size and modification time of the file at `path`, or of every file under it:
    a rewritten model file changes what was made from it."""
    root = Path(path)
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    return repr([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()])
