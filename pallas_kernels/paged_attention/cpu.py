"""Ragged paged attention for XLA:CPU: decode rows in a C++ kernel, prefill rows as the reference.

XLA:CPU runs the reference's decode path as a gather of every K/V chunk (a copy) and two small
batched dots that read it again; at batch 64 that was half of a decode step's forward on a
2-core CPU. `cpu_decode.cc` reads each sequence's K/V rows in place with an online softmax, as
an XLA FFI custom call, and the rows of prefill chunks still take the reference's tiled path
(compute-bound matmuls XLA does well). Results equal the reference's within float rounding.

The kernel is C++ built on first use with the system's C++ compiler (`$CXX`, else g++/c++),
for this CPU (-march=native), and cached under $JAXSERVE_KERNEL_CACHE (default
~/.cache/jaxserve/kernels) by source, jaxlib and CPU; later processes load the cached library.
`cpu_kernel_unavailable_message()` says why it cannot be used here (no compiler, a failed
build), so the engine can fall back to the pure-jnp reference.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi
from pallas_kernels.paged_attention import reference

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.cc")
_TARGET = "jaxserve_paged_attention_decode"
_FLAGS = cpu_ffi.FLAGS


def _compiler() -> str | None:
    return cpu_ffi.compiler()


def _build(compiler: str) -> Path:
    """The kernel's shared library for this source, jaxlib and CPU (built when missing)."""
    return cpu_ffi.build(_SOURCE, compiler, _FLAGS)


@functools.cache
def _load() -> str | None:
    """Build (once per machine) and register the kernel; None on success, else why not."""
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (set $CXX, or install g++)"
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"building {_SOURCE.name} failed: {e}"
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxservePagedDecode), "cpu")
    return None


def cpu_kernel_unavailable_message() -> str | None:
    """Why the CPU attention kernel cannot run here, or None when it can (building it on the
    first call)."""
    reason = _load()
    return None if reason is None else f"the CPU paged-attention kernel is unavailable: {reason}"


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "decode_only", "attention_chunk"),
)
def ragged_paged_attention_cpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    sinks: jax.Array | None = None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    decode_only: bool = False,
    attention_chunk: int | None = None,
    causal_ext: jax.Array | None = None,
) -> jax.Array:
    """`ragged_paged_attention_reference` (same arguments, same result) with its decode rows
    computed by the C++ kernel. Other dtypes than f32 (bf16, fp8 caches), attention sinks and
    chunked attention take the reference whole; causal_ext (bidirectional images) applies to
    the multi-token rows, which are the reference's."""
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    uncommon = sinks is not None or attention_chunk is not None
    if uncommon or not (q.dtype == k_cache.dtype == v_cache.dtype == jnp.float32):
        return reference.ragged_paged_attention_reference(
            *args,
            sinks,
            **kw,
            decode_only=decode_only,
            attention_chunk=attention_chunk,
            causal_ext=causal_ext,
        )
    if (reason := cpu_kernel_unavailable_message()) is not None:
        raise RuntimeError(reason)
    # The decode rows (one query token per sequence), every other row zero: the reference's
    # `_decode`, in the C++ kernel.
    out = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        *args,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )
    if decode_only or q.shape[0] == 1:
        return out
    return reference.multi_token_rows(*args, out, **kw, causal_ext=causal_ext)
