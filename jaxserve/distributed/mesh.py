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
        devices = spread_devices(tensor_parallel_size)
    devices = list(devices if devices is not None else jax.local_devices())
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs between 1 and {len(devices)} "
            f"devices; {len(devices)} {devices[0].platform} device(s) are available"
        )
    devs = np.array(devices[:tensor_parallel_size])
    return Mesh(devs, (TP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def pipeline_meshes(tensor_parallel_size: int, pipeline_parallel_size: int) -> list[Mesh]:
    """Each pipeline stage's tp mesh, stage 0 first. The stages take the model's devices (one
    process's first tp * pp, or over several processes each one's even share, in process
    order) tp at a time from the LAST stage on: the last stage, which samples, is on the first
    devices, rank 0's, where the engine core reads the sampled tokens. A stage spans whole
    processes, or a process holds whole stages (validate_pipeline_layout)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    multi = jax.process_count() > 1
    devices = spread_devices(tp * pp) if multi else jax.local_devices()[: tp * pp]
    if len(devices) < tp * pp:
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs "
            f"{tp * pp} devices; there are {len(devices)}"
        )
    return [make_mesh(tp, devices[(pp - 1 - s) * tp : (pp - s) * tp]) for s in range(pp)]


def validate_pipeline_layout(
    tensor_parallel_size: int, pipeline_parallel_size: int, nnodes: int
) -> None:
    """ValueError unless tp x pp devices split over nnodes hosts evenly, each host holding
    whole stages or each stage spanning whole hosts."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    per, rest = divmod(tp * pp, nnodes)
    if rest or per == 0 or (per % tp and tp % per):
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} over nnodes={nnodes}: "
            "each host must hold whole stages (tp x pp / nnodes a multiple of tp) or each "
            "stage span whole hosts (tp a multiple of tp x pp / nnodes)"
        )


def spread_devices(num_devices: int) -> list:
    """num_devices over every process of the JAX cluster: each one's `devices_per_process`
    share of its devices (lowest ids first), in process order."""
    counts = devices_per_process(num_devices, jax.process_count())
    by_process = [
        sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for p in range(jax.process_count())
    ]
    return [d for local, n in zip(by_process, counts, strict=True) for d in local[:n]]


def devices_per_process(tensor_parallel_size: int, num_processes: int) -> list[int]:
    """How many devices each process (host) gives a model spread over num_processes: an even
    share, the first tensor_parallel_size % num_processes taking one more (e.g. a 9-head
    model's tp 3 over two hosts: 2 + 1)."""
    share, extra = divmod(tensor_parallel_size, num_processes)
    return [share + (p < extra) for p in range(num_processes)]


def check_local_devices(
    tensor_parallel_size: int, nnodes: int = 1, pipeline_parallel_size: int = 1
) -> None:
    """ValueError unless this process can take its part of a model spread over
    tensor_parallel_size x pipeline_parallel_size devices on nnodes hosts: nnodes processes
    joined the JAX cluster, and this one has its `devices_per_process` share of local
    devices. Called where the engine config is resolved (EngineArgs.create_engine_config),
    before any mesh is made."""
    if jax.process_count() != nnodes:
        raise ValueError(
            f"nnodes={nnodes} but {jax.process_count()} processes joined the JAX cluster"
        )
    available = jax.local_device_count()
    total = tensor_parallel_size * pipeline_parallel_size
    needed = devices_per_process(total, nnodes)[jax.process_index()]
    if needed > available:
        pp = pipeline_parallel_size
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}"
            + (f" x pipeline_parallel_size={pp}" if pp > 1 else "")
            + (f" over nnodes={nnodes}" if nnodes > 1 else "")
            + f" needs {needed} devices here; there are {available} local "
            f"{jax.default_backend()} devices"
        )
