"""Building the C++ XLA FFI kernels of XLA:CPU (paged_attention/cpu_decode.cc,
grouped_matmul/cpu_packed.cc) on first use: with the system's C++ compiler (`$CXX`, else
g++ / c++), for this CPU (-march=native), cached under $JAXSERVE_KERNEL_CACHE (default
~/.cache/jaxserve/kernels) by source, jaxlib and CPU, so later processes load the library."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from jaxserve import envs

# No -ffast-math: linked into a shared library it can set flush-to-zero for the whole process.
# Reductions vectorize by `omp simd` pragmas, exp by the kernel's own polynomial.
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-std=c++17",
    "-shared",
    "-fPIC",
]


def kernel_cache_dir() -> Path:
    """$JAXSERVE_KERNEL_CACHE, or ~/.cache/jaxserve/kernels."""
    return Path(envs.JAXSERVE_KERNEL_CACHE)


def compiler() -> str | None:
    """The C++ compiler to build with, or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(source: Path, compiler: str, flags: list[str] = FLAGS) -> Path:
    """`source`'s shared library for this jaxlib and CPU (built when missing)."""
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    parts = (source.read_bytes(), include, jax.__version__, _cpu_signature(), *flags, compiler)
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
    lib = kernel_cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (data-parallel engines) may build at once: each writes its own file
    # and renames it into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [compiler, *flags, f"-I{include}", str(source), "-o", tmp, "-lpthread"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # ~5-10 s
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
