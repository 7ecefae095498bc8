"""Packed weights multiplied on XLA:CPU by a C++ kernel (`cpu_packed.cc`, an XLA FFI custom
call) that decodes each weight once into a small f32 panel in L1 and multiplies every row by
it there: XLA:CPU would write the whole decoded weight in f32 and read it back (and converts
fp8 element by element), so a packed format ran 4-5x slower than its f32 original though it
reads 2-8x fewer bytes. Built and cached like the CPU attention kernel (pallas_kernels/
cpu_ffi.py); without a compiler, XLA's decode-then-dot path runs (`unavailable_message`).

Formats (packed.py's layouts): 0 int4 (uint8 codes, f32 scale and offset), 1 MXFP4 (uint8
codes, e8m0 scale), 2 fp8 e4m3 (f32 scale), 3 int8 with f32 scale and offset (GGUF's blocks).
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi
from pallas_kernels.grouped_matmul.packed import Packed

_SOURCE = Path(__file__).with_name("cpu_packed.cc")
_TARGET = "jaxserve_packed_matmul"
# The micro-kernel's vector multiply-adds are written as a * b + c: contracted to FMAs (C++17
# is an ISO mode, where GCC would leave them as a multiply and an add).
_FLAGS = [*cpu_ffi.FLAGS, "-ffp-contract=fast"]


@functools.cache
def _load() -> str | None:
    """Build (once per machine) and register the kernel; None on success, else why not."""
    compiler = cpu_ffi.compiler()
    if compiler is None:
        return "no C++ compiler found (set $CXX, or install g++)"
    try:
        lib = ctypes.CDLL(str(cpu_ffi.build(_SOURCE, compiler, _FLAGS)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"building {_SOURCE.name} failed: {e}"
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxservePackedMatmul), "cpu")
    return None


def unavailable_message() -> str | None:
    """Why the kernel cannot run here, or None (building it on the first call)."""
    reason = _load()
    return None if reason is None else f"the CPU packed-matmul kernel is unavailable: {reason}"


def format_of(w: Packed) -> int | None:
    """The kernel's format number for these packed arrays, or None for one it does not take."""
    k, s = jnp.dtype(w.kernel.dtype), jnp.dtype(w.scale.dtype)
    if k == jnp.uint8:
        return 1 if s == jnp.uint8 else 0 if w.offset is not None else None
    if k == jnp.float8_e4m3fn and s == jnp.float32 and w.offset is None:
        return 2
    if k == jnp.int8 and s == jnp.float32 and w.offset is not None:
        return 3
    return None


def runs(x: jax.Array, w: Packed) -> bool:
    """Whether the kernel takes this call: on CPU, f32 rows, a format it knows, and built."""
    if jax.default_backend() != "cpu" or x.dtype != jnp.float32 or format_of(w) is None:
        return False
    return unavailable_message() is None


def packed_matmul_cpu(x: jax.Array, w: Packed, group_sizes: jax.Array) -> jax.Array:
    """x f32 [M, K], w packed [E, K, N], group_sizes i32[E] -> f32 [M, N]: rows of group e
    times expert e's decoded weight, rows past the groups zero (a grouped matmul's contract)."""
    offset = w.offset if w.offset is not None else jnp.zeros((1,), jnp.float32)
    scale = w.scale if w.scale.dtype == jnp.uint8 else w.scale.astype(jnp.float32)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    return call(
        x,
        w.kernel,
        scale,
        offset.astype(jnp.float32),
        group_sizes.astype(jnp.int32),
        fmt=np.int64(format_of(w)),
        group=np.int64(w.group),
    )
