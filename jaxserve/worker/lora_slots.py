"""LoRA adapters on the devices: --max-loras fixed slots in every targeted projection
(layers/lora.py), filled from a host cache of loaded adapters as the steps need them.

  add_adapter   a request's adapter loaded and fused on the host (models/lora.py) when it
                arrives, so a bad adapter fails that request alone; the host cache keeps every
                adapter a live request uses, plus up to --max-cpu-loras others (LRU)
  prepare       before a step: the adapter of each request the input batch holds (the
                running set, which the scheduler keeps to max_loras distinct adapters) into a
                device slot (free, or the least recently used one no row needs), and each
                row's slot, which forward_inputs spreads over the row's tokens
  remove_adapter its host copy and slot dropped once no live request uses it

A slot is written by one executable compiled at start-up (all of a slot's arrays at once, a
dynamic-update-slice of each stack), so the first use of an adapter never compiles.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.distributed.sharding import put
from jaxserve.layers.lora import LoRAWeights
from jaxserve.lora_request import LoRARequest
from jaxserve.models.lora import LORA_PROJECTIONS, AdapterWeights, load_adapter, projection_dims
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_feature import LoweringInputs, StepFeature
from jaxserve.worker.step_types import ForwardInputs, StepBatch

logger = logging.getLogger(__name__)

# Column-parallel projections (output split over tp): B split as the kernel's columns; the
# row-parallel ones (input split): A split as the kernel's rows (XLA sums the shrink).
_COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
# Where a step without adapter tokens skips the LoRA products by a runtime branch
# (layers/lora.py: a GPU would sync on every conditional's predicate).
SKIP_IDLE_PLATFORMS = ("cpu",)


class LoRASlots(StepFeature):
    name = "lora"

    def __init__(
        self,
        model: Any,
        config: LoRAConfig,
        model_config: ModelConfig,
        mesh: Mesh,
        kv_replicas: int = 1,
    ):
        """Attach zeroed slots to every targeted projection of `model` (before it is split
        into the step's parameters; `attach` then finds them there)."""
        self.config, self.model_config, self.kv_replicas = config, model_config, kv_replicas
        dtype = model_config.dtype if config.lora_dtype == "auto" else config.lora_dtype
        self.dtype = jnp.dtype(dtype)
        self.num_slots, self.rank = config.max_loras, config.max_lora_rank
        dims = projection_dims(model_config, kv_replicas)
        skip_idle = mesh.devices.flat[0].platform in SKIP_IDLE_PLATFORMS
        for layer in model.layers:
            for fused, (module, parts) in LORA_PROJECTIONS.items():
                (d_in, d_out), p = dims[fused], len(parts) * self.rank
                column = fused in _COLUMN_PARALLEL
                a_spec, b_spec = (
                    (P(), P(None, None, TP_AXIS)) if column else (P(None, TP_AXIS), P())
                )
                a = put(
                    np.zeros((self.num_slots, d_in, p), self.dtype), NamedSharding(mesh, a_spec)
                )
                b = put(
                    np.zeros((self.num_slots, p, d_out), self.dtype), NamedSharding(mesh, b_spec)
                )
                getattr(getattr(layer, module), fused).lora = nnx.data(LoRAWeights(a, b, skip_idle))
        model.num_lora_slots = self.num_slots
        self._replicated = NamedSharding(mesh, P())
        self._leaves: list[int] = []  # each slot array's index among the step's parameters
        self._keys: list[tuple[int, str, str]] = []  # and its (layer, projection, "a" | "b")
        self.slot_ids = [0] * self.num_slots  # the adapter (lora_int_id) in each slot, 0: none
        self._slot_lru: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(self.num_slots)
        )
        self.host: collections.OrderedDict[int, AdapterWeights] = collections.OrderedDict()
        self._removed: set[int] = set()

    def attach(self, state: Any) -> None:
        """Find the slot arrays among the flat parameters of nnx.split(model)'s state."""
        for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
            keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
            if "lora" in keys:
                at = keys.index("lora")
                self._leaves.append(index)
                self._keys.append((int(keys[keys.index("layers") + 1]), keys[at - 1], keys[at + 1]))

    # ------------------------------------------------------------------ the host cache
    def add_adapter(self, request: LoRARequest, live: Callable[[], set[int]]) -> None:
        """Load a request's adapter into the host cache unless it is there (or resident);
        raises what models/lora.py::load_adapter raises for a bad one. live: the adapter ids
        of the requests the engine holds (never evicted)."""
        lora_id = request.lora_int_id
        self._removed.discard(lora_id)
        if self._removed:
            self._sweep(live())
        if lora_id in self.host:
            self.host.move_to_end(lora_id)
            return
        self.host[lora_id] = load_adapter(
            request.lora_path,
            self.model_config,
            max_rank=self.rank,
            kv_replicas=self.kv_replicas,
            dtype=self.dtype,
        )
        logger.info(
            "LoRA adapter %r (id %d) loaded from %s", request.lora_name, lora_id, request.lora_path
        )
        if len(self.host) > self.config.cpu_loras:  # the least recently used unused ones go
            keep = live() | {lora_id}
            for old in [i for i in self.host if i not in keep]:
                if len(self.host) <= self.config.cpu_loras:
                    break
                del self.host[old]

    def remove_adapter(self, lora_id: int, live: set[int]) -> None:
        """Forget an adapter (its host copy and device slot) once no live request uses it."""
        self._removed.add(lora_id)
        self._sweep(live)

    def _sweep(self, live: set[int]) -> None:
        """Forget the removed adapters no live request uses any more."""
        for gone in [i for i in self._removed if i not in live]:
            self._removed.discard(gone)
            self.host.pop(gone, None)
            if gone in self.slot_ids:
                self.slot_ids[self.slot_ids.index(gone)] = 0

    # ------------------------------------------------------------------ the device slots
    def prepare(self, so, ib: InputBatch, params: list, executables) -> None:
        """Put the adapters of the input batch's requests (the running set, after the step's
        update) in slots, writing `params` in place, and set every row's slot in
        `ib.lora_slots`: numpy over the rows, a loop over the few distinct adapters."""
        needed = set(np.unique(ib.lora_ids).tolist()) - {0}  # a free row's id is 0
        if len(needed) > self.num_slots:  # the scheduler's admission keeps this from happening
            raise RuntimeError(f"a step holds {len(needed)} adapters, max_loras={self.num_slots}")
        ib.lora_slots[:] = -1
        for lora_id in needed:
            if lora_id not in self.slot_ids:
                self._load_slot(lora_id, needed, params, executables)
            slot = self.slot_ids.index(lora_id)
            self._slot_lru.move_to_end(slot)
            ib.lora_slots[ib.lora_ids == lora_id] = slot

    def _load_slot(self, lora_id: int, needed: Iterable[int], params: list, executables) -> None:
        slot = next(
            s for s in self._slot_lru if self.slot_ids[s] not in needed or not self.slot_ids[s]
        )
        free = [s for s in self._slot_lru if not self.slot_ids[s]]
        slot = free[0] if free else slot
        weights = self.host[lora_id]  # a live request's: never evicted
        values = [weights[layer, fused][0 if ab == "a" else 1] for layer, fused, ab in self._keys]
        stacks = [params[i] for i in self._leaves]
        new = executables["lora_slot",](stacks, np.int32(slot), values)
        for i, array in zip(self._leaves, new, strict=True):
            params[i] = array
        self.slot_ids[slot] = lora_id

    def forward_inputs(
        self,
        forward: ForwardInputs,
        batch: StepBatch | None,
        ib: InputBatch | None,
        *,
        spec: bool = False,
    ) -> ForwardInputs:
        """Each token's slot (-1: none; padding tokens none)."""
        slots = np.full(forward.input_ids.shape[0], -1, np.int32)
        if batch is not None:
            n = int(batch.num_scheduled.sum())
            slots[:n] = ib.lora_slots[forward.token_rows[:n]]
        return forward._replace(lora_slots=slots)

    def lowerings(self, inputs: LoweringInputs) -> dict[tuple, Callable[[], Any]]:
        """The slot writer, compiled at start-up with the steps."""
        stacks = [inputs.params[i] for i in self._leaves]
        spec = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding) for s in stacks]
        values = [
            jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=self._replicated) for s in stacks
        ]
        write = jax.jit(_write_slot, out_shardings=[s.sharding for s in stacks])
        return {("lora_slot",): lambda: write.lower(spec, np.int32(0), values)}


def _write_slot(stacks: list[jax.Array], slot: jax.Array, values: list[jax.Array]) -> list:
    """Each stack [S, ...] with values[i] [...] written at slot."""
    return [
        lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), slot, 0)
        for s, v in zip(stacks, values, strict=True)
    ]
