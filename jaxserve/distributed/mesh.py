"""The device mesh: one `tp` axis over local devices (one process drives them all, SPMD)."""

import jax
import numpy as np
from jax.sharding import Mesh

TP_AXIS = "tp"


def make_mesh(tensor_parallel_size: int = 1, devices: list | None = None) -> Mesh:
    """A 1-D Mesh named ('tp',) over the first `tensor_parallel_size` local devices.

    The axis is Auto (sharding propagated by XLA), the same on jax 0.10 and 0.11.
    """
    devices = list(devices if devices is not None else jax.local_devices())
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs between 1 and {len(devices)} "
            f"devices; {len(devices)} {devices[0].platform} device(s) are available"
        )
    devs = np.array(devices[:tensor_parallel_size])
    return Mesh(devs, (TP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
