"""What RL trainers and operators call on a running engine core, between its steps (utility
calls): sleep and wake, new weights, scheduling paused in place, and calls on the runner.

  sleep(level) / wake_up(tags)   free and bring back the weights and the KV cache
                                 (worker/device_state.py); needs --enable-sleep-mode
  update_weights(weights)        new weights by the engine's or HF names; the prefix cache
                                 is reset (its blocks hold the old weights' keys and values)
  reload_weights(path)           every weight read again from a checkpoint directory
  start_weight_update / update_weights_from / finish_weight_update
                                 vLLM's weight transfer: tensors staged from shared memory
                                 or a shared directory (engine/weight_transfer.py), applied
                                 together at the finish (a fused qkv needs q, k and v)
  abort_all_requests             each finishes with finish_reason "abort" (pause mode "abort")
  pause_scheduler / resume_scheduler
                                 nothing new is scheduled; the requests keep their place and
                                 their KV blocks (vLLM's pause mode "keep")
  collective_rpc(method, ...)    a read-only runner method (COLLECTIVE_RPC_METHODS) on
                                 every worker (one here: multi-host ranks are not reached)

The step executables take the weights and the KV cache as arguments, in the layouts they were
compiled for; everything here keeps those layouts, so nothing recompiles.
"""

from __future__ import annotations

import logging
import pickle
import weakref
from typing import Any

import jax

from jaxserve.config import compat
from jaxserve.core.request import RequestStatus
from jaxserve.engine.weight_transfer import WeightTransfer
from jaxserve.ipc.messages import EngineCoreOutput
from jaxserve.worker.device_state import DeviceState, device_bytes

logger = logging.getLogger(__name__)

# What collective_rpc calls on the runner by name (an HTTP client's /collective_rpc too): read
# only. Never initialize_kv_cache, compile_all, dispatch, ...: they reallocate the cache,
# recompile or step outside the core's loop, and would end the engine.
COLLECTIVE_RPC_METHODS = ("kv_bytes_per_block", "max_step_tokens", "ready_token_buckets")


class CoreControl:
    """An engine core's control surface (EngineCore.control; its utility calls by these
    names reach it): it owns the device state of sleep and weight updates and the weight
    transfer in progress, and acts on the core's scheduler, runner and steps in flight."""

    def __init__(self, core: Any):
        """core: the EngineCore (its config, scheduler, runner, in_flight and
        scheduling_paused), held weakly: the core holds this, and a reference cycle would keep
        a finished engine's arrays alive while the heap is frozen (engine/gc_heap.py)."""
        try:
            self.core = weakref.proxy(core)
        except TypeError:  # a stand-in that takes no weak reference (tests)
            self.core = core
        self._device_state: DeviceState | None = None
        self._transfer: WeightTransfer | None = None

    @property
    def config(self):
        return self.core.config

    @property
    def scheduler(self):
        return self.core.scheduler

    def _device(self) -> DeviceState:
        # sleep mode with these is refused at start-up; weight updates (no flag) here, for the
        # same reason (config/compat.py's table)
        if self.config.parallel.nnodes > 1:
            raise ValueError(compat.reason("several hosts", "sleep mode"))
        if self.config.parallel.pipeline_parallel_size > 1:
            raise ValueError(compat.reason("pipeline parallel", "sleep mode"))
        if self._device_state is None:  # (ValueError from a runner without weights)
            self._device_state = self.core.runner.device_state()
        return self._device_state

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, level: int = 1) -> dict:
        """Free the device memory of the weights (level 1: kept on the host) and the KV
        cache. The core must hold no request (pause or finish them first)."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep needs the engine started with enable_sleep_mode=True")
        if self.scheduler.has_unfinished_requests() or self.core.in_flight:
            raise ValueError(
                f"sleep: {self.scheduler.num_unfinished_requests} requests are in the engine; "
                "pause with mode 'abort' or 'wait' first"
            )
        state = self._device()
        before = _live_bytes()
        self.scheduler.kv_cache_manager.reset_prefix_cache()  # their contents are lost
        freed = state.sleep(level)
        after = _live_bytes()
        logger.info(
            "sleep level %d: %.1f MiB of weights and KV cache freed (live arrays %.1f -> %.1f MiB)",
            level,
            freed / 2**20,
            before / 2**20,
            after / 2**20,
        )
        return {"freed_bytes": freed, "live_bytes_before": before, "live_bytes_after": after}

    def wake_up(self, tags: list[str] | None = None) -> dict:
        state = self._device()
        if not state.asleep:
            return {"live_bytes": _live_bytes()}
        state.wake_up(tags)
        return {"live_bytes": _live_bytes()}

    def is_sleeping(self) -> bool:
        return self._device_state is not None and bool(self._device_state.asleep)

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: dict[str, Any]) -> dict:
        """New weights (name -> array), all in the engine's layout or all HF-named."""
        self._wait_in_flight()
        counts = self._device().update(weights)
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        logger.info("weights updated: %d adopted, %d copied", counts["adopted"], counts["copied"])
        return counts

    def reload_weights(self, path: str | None = None) -> int:
        """Every weight read again from `path` (default: the model's own checkpoint)."""
        self._wait_in_flight()
        n = self._device().reload(path or self.config.model_path)
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        return n

    def weight_layout(self) -> dict[str, list]:
        """Each parameter's engine name -> [shape, dtype] (what update_weights adopts)."""
        return {name: [list(a.shape), str(a.dtype)] for name, a in self._device().names().items()}

    def init_weight_transfer_engine(self, init_info: dict) -> bool:
        self._transfer = WeightTransfer(init_info)
        return True

    def start_weight_update(self, is_checkpoint_format: bool = True) -> bool:
        if self._transfer is None:
            raise ValueError("init_weight_transfer_engine first")
        self._transfer.start(is_checkpoint_format)
        return True

    def update_weights_from(self, update_info: dict) -> int:
        """Stage the tensors `update_info` names in the transfer (applied at the finish)."""
        if self._transfer is None:
            raise ValueError("init_weight_transfer_engine first")
        return self._transfer.stage(update_info)

    def finish_weight_update(self) -> dict:
        if self._transfer is None:
            raise ValueError("init_weight_transfer_engine first")
        weights, checkpoint_format = self._transfer.finish()
        if not checkpoint_format:
            unknown = sorted(set(weights) - set(self._device().index))
            if unknown:
                raise ValueError(f"{unknown[0]} is not an engine weight name")
        return self.update_weights(weights)

    def _wait_in_flight(self) -> None:
        """Let the steps on the devices finish before their weights are swapped."""
        for _, pending in self.core.in_flight:
            jax.block_until_ready([x for x in jax.tree.leaves(pending) if isinstance(x, jax.Array)])

    # ------------------------------------------------------------------ pause
    def abort_all_requests(self) -> int:
        """Abort every request; each finishes with finish_reason "abort" (its output goes
        out with the next step's). Returns how many."""
        # (the scheduler's own: the core process routes these outputs by their request)
        aborted = self.scheduler.finish_requests(
            list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED
        )
        self.scheduler.pending_outputs.extend(
            EngineCoreOutput(r.request_id, [], "abort") for r in aborted
        )
        return len(aborted)

    def pause_scheduler(self) -> bool:
        self.core.scheduling_paused = True
        return True

    def resume_scheduler(self) -> bool:
        self.core.scheduling_paused = False
        return True

    # ------------------------------------------------------------------ calls on the runner
    def collective_rpc(
        self, method: str | bytes, args: list | None = None, kwargs: dict | None = None
    ) -> list:
        """`method` of the runner, one of COLLECTIVE_RPC_METHODS by name, or a function
        pickled by LLM.collective_rpc (bytes: called with the runner first; the HTTP route and
        AsyncLLM send names only), run on every worker; their results, one per worker."""
        if isinstance(method, bytes):
            fn = pickle.loads(method)  # noqa: S301 (the engine's own frontend sent it)
            return [fn(self.core.runner, *(args or ()), **(kwargs or {}))]
        if method not in COLLECTIVE_RPC_METHODS:
            raise ValueError(
                f"collective_rpc: {method!r} is not a runner method it calls; it calls "
                f"{', '.join(COLLECTIVE_RPC_METHODS)}"
            )
        if not callable(getattr(self.core.runner, method, None)):
            raise ValueError(f"this engine's runner has no method {method!r}")
        return [getattr(self.core.runner, method)(*(args or ()), **(kwargs or {}))]


def _live_bytes() -> int:
    """The bytes of every live JAX array in this process (on CPU, the device memory)."""
    return device_bytes(jax.live_arrays())
