"""The grouped matmul of a mixture-of-experts layer: rows sorted by expert, each group of rows
times its expert's weights, `jax.lax.ragged_dot`'s contract (its reference here):

    grouped_matmul(x [N, K], w [G, K, F], group_sizes i32[G]) -> [N, F]

rows sum(group_sizes[:g]) .. + group_sizes[g] - 1 times w[g]; rows past the groups are zero.
w may be kept packed (`packed.Packed`: fp8 with block scales, int4, MXFP4): the CPU tile loop
decodes one tile's expert at a time, the Mosaic GPU kernel inside the matmul; the others
decode the stack whole before it.

Implementations, one chosen per call as it is traced (`choose`):
  - "tiles" (CPU): `cpu.tiled`, a loop over tiles of rows, each tile one dot with its group's
    weights: XLA:CPU lowers ragged_dot as a dense dot over every group (G times the work and a
    [G, N, F] temporary).
  - "tokamax" (NVIDIA sm_90 and later, with the `gpu` extra's tokamax installed, when
    `$JAXSERVE_MOE_KERNEL=tokamax` asks for it): tokamax's Pallas Mosaic GPU ragged_dot, which
    reads only the weights of groups that have rows. XLA lowers ragged_dot on NVIDIA as a dense
    dot over every group, reading all E experts where a decode step routes k of them
    (benchmarks/kernels/bench_moe_gmm.py measures both). Not the default: an engine with it did
    not finish compiling its step shapes in 95 s on an H200, where XLA's took 33 s
    (benchmarks/results/gpu-h200-2026-12-04b).
  - "mosaic" (NVIDIA sm_90 and later, jax >= 0.11, when `$JAXSERVE_MOE_KERNEL=mosaic` asks
    for it): our own Mosaic GPU kernel (mosaic.py), which reads the routed experts only and
    decodes packed weights (MXFP4, int4, fp8 block, GGUF int8) inside the kernel. Correct in
    Mosaic GPU's interpreter and lowered for CUDA; not yet run on a GPU, hence not the default.
  - "xla": jax.lax.ragged_dot, everywhere else, and where tokamax refuses a shape.
`$JAXSERVE_MOE_KERNEL` (tiles | tokamax | mosaic | xla) forces one where it can run.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from jaxserve import envs
from pallas_kernels.grouped_matmul import cpu_packed
from pallas_kernels.grouped_matmul.cpu import tiled
from pallas_kernels.grouped_matmul.packed import Packed, dequantize

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("tiles", "tokamax", "mosaic", "xla")


def reference(x: jax.Array, w: jax.Array | Packed, group_sizes: jax.Array) -> jax.Array:
    """x [N, K], w [G, K, F], group_sizes i32[G] -> [N, F] (jax.lax.ragged_dot; packed
    weights decoded first)."""
    if isinstance(w, Packed):
        w = w.dense(x.dtype)
    return jax.lax.ragged_dot(x, w, group_sizes)


@functools.cache
def _tokamax_ragged_dot():
    """tokamax.ragged_dot, or None where it is not installed (it needs jax >= 0.11)."""
    try:
        import tokamax
    except ModuleNotFoundError as e:
        if e.name == "tokamax":
            logger.info("tokamax is not installed: MoE layers run jax.lax.ragged_dot")
        else:  # installed, but not whole (e.g. xprof, which it imports, missing)
            logger.warning("tokamax does not import (%s): MoE layers run jax.lax.ragged_dot", e)
        return None
    return tokamax.ragged_dot


@functools.cache
def _mosaic():
    """The Mosaic GPU kernel's module, or None where this jax cannot compile it (< 0.11: its
    layouts are inferred by Mosaic GPU's constraint solver, which 0.10 lacks)."""
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11):
        return None
    from pallas_kernels.grouped_matmul import mosaic

    return mosaic


def _target() -> jax.Device:
    """The device a trace compiles for: the default device where one is set (a deviceless
    GPU target among them: benchmarks/count_kernels.py), else the default backend's first."""
    device = jax.config.jax_default_device
    if isinstance(device, str):  # a platform name (JAX_DEFAULT_DEVICE=cpu)
        return jax.devices(device)[0]
    return device or jax.devices()[0]


def _sm90_or_later(device: jax.Device) -> bool:
    try:
        return float(getattr(device, "compute_capability", "0")) >= 9.0
    except ValueError:
        return False


def choose(x: jax.Array, w: jax.Array | Packed) -> str:
    """The implementation for these operands on the default backend (see the module doc)."""
    forced = envs.JAXSERVE_MOE_KERNEL
    device = _target()
    if device.platform == "cpu":
        return "xla" if forced == "xla" else "tiles"
    dtype = x.dtype if isinstance(w, Packed) else w.dtype  # packed: decoded into x's dtype
    mosaic = _mosaic() if device.platform == "gpu" and forced == "mosaic" else None
    if mosaic is not None and _sm90_or_later(device) and mosaic.fits(x, w):
        return "mosaic"
    if device.platform != "gpu" or forced != "tokamax" or x.dtype != dtype:
        return "xla"
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return "xla"
    if not _sm90_or_later(device) or _tokamax_ragged_dot() is None:
        return "xla"
    return "tokamax"


def grouped_matmul(x: jax.Array, w: jax.Array | Packed, group_sizes: jax.Array) -> jax.Array:
    """x [N, K], w [G, K, F] (or packed), group_sizes i32[G] -> [N, F]: the module doc's
    contract."""
    impl = choose(x, w)
    if impl == "tiles":
        return tiled(x, w, group_sizes)
    if impl == "mosaic":
        return _mosaic().grouped_matmul_mosaic(x, w, group_sizes)
    if isinstance(w, Packed):
        w = w.dense(x.dtype)
    if impl == "tokamax":
        try:
            out = _tokamax_ragged_dot()(x, w, group_sizes, implementation="mosaic")
        except NotImplementedError as e:  # a shape its kernels do not take: traced again
            logger.info("tokamax ragged_dot refused x %s w %s (%s): XLA's", x.shape, w.shape, e)
            return reference(x, w, group_sizes)
        # its kernel leaves rows past the groups unwritten
        rows = jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes)
        return jnp.where(rows, out, jnp.zeros((), out.dtype))
    return reference(x, w, group_sizes)


def packed_matmul(
    x: jax.Array,
    kernel: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None,
    group: int,
    native: bool = True,
) -> jax.Array:
    """x [T, K] times one packed weight (packed.py's arrays, [K(/2), N]) -> [T, N]: the C++
    kernel on CPU where it runs (and `native`), else the weight decoded in x's dtype and a
    dot (XLA fuses the decode into the dot's operand on GPU when it can)."""
    w = Packed(kernel[None], scale[None], None if offset is None else offset[None], group)
    if native and cpu_packed.runs(x, w):
        return cpu_packed.packed_matmul_cpu(x, w, jnp.full((1,), x.shape[0], jnp.int32))
    return x @ dequantize(kernel, scale, offset, group, x.dtype)


def channel_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """x [T, K] times an int8 or fp8 e4m3 kernel [K, N] with one scale per output channel,
    f32[N] -> [T, N]: on CPU the C++ kernel (one group of K rows: an int8 kernel as GGUF's
    blocks with a zero offset), else (x @ kernel) * scale, the kernel converted in x's dtype
    inside the dot's fusion."""
    k, n = kernel.shape
    offset = jnp.zeros((1, n), jnp.float32) if kernel.dtype == jnp.int8 else None
    w = Packed(kernel[None], scale.reshape(1, 1, n), None if offset is None else offset[None], k)
    if k % 2 == 0 and cpu_packed.runs(x, w):
        return cpu_packed.packed_matmul_cpu(x, w, jnp.full((1,), x.shape[0], jnp.int32))
    return (x @ kernel.astype(x.dtype)) * scale.astype(x.dtype)
