"""Arrays from one pipeline stage's devices to the next one's when the two stages are not both
this one process's (pipeline parallelism over several hosts, worker/pipeline_stages.py).

Within one process `jax.device_put` moves an array between two meshes; across processes no
process holds both ends. A `StageLink` is a program over the union of the two stages'
devices, a (pp=2, tp) mesh, that `ppermute`s every device's shard along pp: each source device
sends its shard to the destination device of the same tp index. Every process with a device in
either stage calls it, in the same order (the multi-host runner replays each call on every
rank), each giving its own devices' shards: the source's its array's, the destination's zeros;
the destination's processes build the moved array from what arrived.

No reshape on either side: the union array is the two stages' arrays stacked along axis 0, so
its sharding is the stage array's with the pp axis put in front of axis 0's, and each device's
shard is exactly its shard of the stage array.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PP_AXIS = "pp"


def mesh_processes(mesh: Mesh) -> set[int]:
    """The processes (hosts) whose devices `mesh` spans."""
    return {d.process_index for d in mesh.devices.flat}


def is_local(mesh: Mesh) -> bool:
    """Whether this process drives any of `mesh`'s devices (and so calls its programs)."""
    return jax.process_index() in mesh_processes(mesh)


def crosses_processes(src: Mesh, dst: Mesh) -> bool:
    """Whether moving arrays from stage mesh `src` to `dst` needs a StageLink: they span more
    than one process together (the same answer on every process)."""
    return len(mesh_processes(src) | mesh_processes(dst)) > 1


class StageLink:
    """The hand-off from stage mesh `src` to `dst` (the same shape: tp devices each)."""

    def __init__(self, src: Mesh, dst: Mesh):
        if src.devices.shape != dst.devices.shape:
            raise ValueError(f"stage meshes differ: {src.devices.shape} and {dst.devices.shape}")
        self.src, self.dst = src, dst
        devices = np.stack([src.devices.reshape(-1), dst.devices.reshape(-1)])
        self.union = Mesh(devices, (PP_AXIS, *src.axis_names))
        self.involved = is_local(src) or is_local(dst)
        self._zeros: dict[tuple, jax.Array] = {}

    def union_sharding(self, spec: P) -> NamedSharding:
        """The stacked array's sharding: `spec` with pp in front of axis 0's mesh axes."""
        first = spec[0] if len(spec) else None
        lead = () if first is None else (first,) if isinstance(first, str) else tuple(first)
        return NamedSharding(self.union, P((PP_AXIS, *lead), *spec[1:]))

    def program(self, spec: P) -> Any:
        """The jitted hand-off of an array sharded `spec` on a stage mesh: union array in,
        union array out (the destination's rows now hold the source's)."""
        sharding = self.union_sharding(spec)

        def send(x):
            return jax.lax.ppermute(x, PP_AXIS, perm=[(0, 1)])

        mapped = jax.shard_map(
            send, mesh=self.union, in_specs=sharding.spec, out_specs=sharding.spec
        )
        return jax.jit(mapped, out_shardings=sharding)

    def union_shape(self, shape: tuple, dtype: Any, spec: P) -> jax.ShapeDtypeStruct:
        """The program's argument for a stage array of `shape` (to lower it)."""
        stacked = (2 * shape[0], *shape[1:])
        return jax.ShapeDtypeStruct(stacked, dtype, sharding=self.union_sharding(spec))

    def pack(self, x: jax.Array | None, shape: tuple, dtype: Any, spec: P) -> jax.Array:
        """The program's argument from this process's shards: x's on the source's devices
        (x: None where this process has none of them), zeros on the destination's."""
        union = self.union_sharding(spec)
        stacked = (2 * shape[0], *shape[1:])
        own = {} if x is None else {s.device: s.data for s in x.addressable_shards}
        shard_shape = NamedSharding(self.dst, spec).shard_shape(shape)
        arrays = [
            own[d] if d in own else self._zero(d, shard_shape, dtype)
            for d in union.addressable_devices_indices_map(stacked)
        ]
        return jax.make_array_from_single_device_arrays(stacked, union, arrays)

    def unpack(self, out: jax.Array, shape: tuple, spec: P) -> jax.Array | None:
        """The moved array on the destination mesh from the program's result (None where this
        process has none of the destination's devices)."""
        dst = NamedSharding(self.dst, spec)
        if not is_local(self.dst):
            return None
        got = {s.device: s.data for s in out.addressable_shards}
        arrays = [got[d] for d in dst.addressable_devices_indices_map(shape)]
        return jax.make_array_from_single_device_arrays(shape, dst, arrays)

    def move(self, x: jax.Array | None, shape: tuple, dtype: Any, spec: P, run=None):
        """x (on the source mesh) on the destination mesh, through `run` (the compiled
        program; None: jit it here, for start-up's one-off moves)."""
        run = run if run is not None else self.program(spec)
        return self.unpack(run(self.pack(x, shape, dtype, spec)), shape, spec)

    def _zero(self, device: Any, shape: tuple, dtype: Any) -> jax.Array:
        key = (device, shape, np.dtype(dtype))
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(shape, dtype), device)
        return self._zeros[key]
