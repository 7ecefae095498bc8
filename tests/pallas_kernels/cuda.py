"""Lowering for CUDA on a machine without a GPU (the `cuda_lowering` tests)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

# The GPU the kernels are tuned for; jax >= 0.11 reads a Triton kernel's target from it
TARGET = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def lower_for_cuda(f: Callable, *args) -> str:
    """The lowered text of jit(f)(*args) for CUDA. Without a visible GPU, under an abstract
    mesh naming an H100: jax 0.11's Triton lowering asks the device for its compute
    capability and refuses without one (jax 0.10 and Mosaic GPU do not need it)."""
    traced = lambda: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()  # noqa: E731
    if jax.devices()[0].platform == "gpu":
        return traced()
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=TARGET)
    with jax.sharding.use_abstract_mesh(mesh):
        return traced()
