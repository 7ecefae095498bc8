"""The device mesh: one `tp` axis over local devices (one process drives them all, SPMD)."""

import jax
import numpy as np
from jax.sharding import Mesh

TP_AXIS = "tp"


def make_mesh(tensor_parallel_size: int = 1, devices: list | None = None) -> Mesh:
    """A 1-D Mesh named ('tp',) over the first `tensor_parallel_size` local devices; with
    several processes (multi-host, distributed/multihost.py), over the first
    `devices_per_process` of each process, in process order.

    The axis is Auto (sharding propagated by XLA), the same on jax 0.10 and 0.11.
    """
    if devices is None and jax.process_count() > 1:
        counts = devices_per_process(tensor_parallel_size, jax.process_count())
        by_process = [
            sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
            for p in range(jax.process_count())
        ]
        devices = [d for local, n in zip(by_process, counts, strict=True) for d in local[:n]]
    devices = list(devices if devices is not None else jax.local_devices())
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs between 1 and {len(devices)} "
            f"devices; {len(devices)} {devices[0].platform} device(s) are available"
        )
    devs = np.array(devices[:tensor_parallel_size])
    return Mesh(devs, (TP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def devices_per_process(tensor_parallel_size: int, num_processes: int) -> list[int]:
    """How many devices each process (host) gives a model spread over num_processes: an even
    share, the first tensor_parallel_size % num_processes taking one more (e.g. a 9-head
    model's tp 3 over two hosts: 2 + 1)."""
    share, extra = divmod(tensor_parallel_size, num_processes)
    return [share + (p < extra) for p in range(num_processes)]


def check_local_devices(tensor_parallel_size: int, nnodes: int = 1) -> None:
    """ValueError unless this process can take its part of a model spread over
    tensor_parallel_size devices on nnodes hosts: nnodes processes joined the JAX cluster, and
    this one has its `devices_per_process` share of local devices. Called where the engine
    config is resolved (EngineArgs.create_engine_config), before any mesh is made."""
    if jax.process_count() != nnodes:
        raise ValueError(
            f"nnodes={nnodes} but {jax.process_count()} processes joined the JAX cluster"
        )
    available = jax.local_device_count()
    needed = devices_per_process(tensor_parallel_size, nnodes)[jax.process_index()]
    if needed > available:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}"
            + (f" over nnodes={nnodes}" if nnodes > 1 else "")
            + f" needs {needed} devices here; there are {available} local "
            f"{jax.default_backend()} devices"
        )
