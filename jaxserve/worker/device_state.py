"""What a ModelRunner holds on its devices, freed and brought back (sleep / wake_up) and
replaced (new weights), always in the layouts its step executables were compiled for, so
nothing recompiles.

  sleep(1)      weights copied to the host (each shard its own copy), then every weight
                and KV cache buffer deleted
  sleep(2)      the same without the host copy (but for parameters no checkpoint holds, such
                as LoRA slots): waking reloads the weights from the model's checkpoint
  wake_up()     weights back (tags=["weights"]) and a zeroed KV cache (["kv_cache"])
  update()      new weights: arrays in the engine's layout (named by their nnx path, e.g.
                `layers.3.self_attn.qkv_proj.kernel`) are adopted as they are when their
                dtype and sharding are the parameter's (zero-copy: the same device buffers),
                else copied once into them; HF-named tensors are built by the loader's
                mapping (models/weight_update.py)

Deleted buffers go back to JAX's allocator; whether another process can then use the memory
depends on that allocator (docs/rl.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxserve.models.weight_update import (
    DictSource,
    checkpoint_source,
    covered_paths,
    read_hf_params,
)

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


def _path(keys: tuple) -> tuple:
    """A leaf's nnx path (the loader's keys: names and layer indices), without the Variable's
    `.value`."""
    out = []
    for k in keys:
        if isinstance(k, jax.tree_util.GetAttrKey):
            continue
        out.append(getattr(k, "key", getattr(k, "idx", k)))
    return tuple(out)


def _key(index: tuple) -> tuple:
    """A shard's index (a tuple of slices, unhashable before Python 3.12) as a dict key."""
    return tuple((s.start, s.stop, s.step) for s in index)


def device_bytes(arrays: Any) -> int:
    """The bytes of the (live) arrays in a tree, summed over their shards."""
    return sum(
        x.nbytes for x in jax.tree.leaves(arrays) if isinstance(x, jax.Array) and not x.is_deleted()
    )


class DeviceState:
    """Sleep, wake and weight updates of one runner (`runner.params`, `.head`, `.kv_caches`)."""

    def __init__(self, runner: Any):
        self.runner = runner
        flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(runner.model))
        self.paths = [_path(keys) for keys, _ in flat]
        if len(self.paths) != len(runner.params):
            raise RuntimeError("the model's state does not match the runner's parameters")
        self.index = {".".join(map(str, p)): i for i, p in enumerate(self.paths)}
        self.shardings = [x.sharding for x in runner.params]
        self.avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in runner.params]
        self.asleep: set[str] = set()  # of TAGS
        self.level = 0
        # Asleep: parameter index -> its shards on the host (level 1: every parameter)
        self._host: dict[int, dict] | None = None

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, level: int) -> int:
        """Free the weights and the KV cache (level 1 keeps the weights on the host);
        returns the device bytes freed."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise RuntimeError(f"the engine is already asleep (level {self.level})")
        runner = self.runner
        freed = device_bytes((runner.params, runner.kv_caches))
        keep = range(len(self.paths))
        if level == 2:  # what the checkpoint cannot give back stays on the host
            source = checkpoint_source(runner.engine_config.model_path)
            rebuilt, _ = covered_paths(source, runner.config, self._kv_replicas(), self.paths)
            keep = [i for i, p in enumerate(self.paths) if p not in rebuilt]
        self._host = {
            i: {_key(s.index): np.asarray(s.data) for s in runner.params[i].addressable_shards}
            for i in keep
        }
        for x in (*runner.params, *runner.kv_caches):
            x.delete()
        runner.kv_caches = None
        self.asleep, self.level = set(TAGS), level
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `tags` names (default: both): the weights (level 1: from the host
        copy; level 2: reloaded from the checkpoint) and a zeroed KV cache."""
        tags = list(TAGS) if tags is None else list(tags)
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            raise ValueError(f"wake_up tags {unknown} are not among {list(TAGS)}")
        runner = self.runner
        if "weights" in tags and "weights" in self.asleep:
            if self.level == 2:
                self._read(checkpoint_source(runner.engine_config.model_path), partial=False)
            self._set_params(
                {
                    i: jax.make_array_from_callback(
                        self.avals[i].shape, self.shardings[i], lambda idx, h=host: h[_key(idx)]
                    )
                    for i, host in self._host.items()
                }
            )
            self._host = None
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            runner.kv_caches = runner.kv.allocate(runner.num_blocks)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = 0

    # ------------------------------------------------------------------ new weights
    def names(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The engine's layout: each parameter's name -> its shape, dtype and sharding."""
        return {
            name: jax.ShapeDtypeStruct(
                self.avals[i].shape, self.avals[i].dtype, sharding=self.shardings[i]
            )
            for name, i in self.index.items()
        }

    def update(self, weights: Mapping[str, Any]) -> dict[str, int]:
        """New weights, by the engine's names (adopted when they are already the parameter's
        dtype and sharding: no copy) or by HF names (built and copied once); a mix is refused.
        Returns how many parameters were adopted and copied."""
        if not weights:
            raise ValueError("update_weights got no weights")
        ours = [n for n in weights if n in self.index]
        if ours and len(ours) < len(weights):
            other = sorted(set(weights) - set(ours))
            raise ValueError(
                f"weights mix the engine's names ({ours[0]}) with others ({other[0]}): "
                "give all in one layout"
            )
        self._check_awake()
        if ours:
            return self._update_ours(weights)
        source = DictSource({n: np.asarray(w) for n, w in weights.items()})
        return {"adopted": 0, "copied": self._read(source, partial=True)}

    def reload(self, path: str) -> int:
        """Every weight read again from a checkpoint (a HF directory or a .gguf file)."""
        self._check_awake()
        return self._read(checkpoint_source(path), partial=False)

    def _update_ours(self, weights: Mapping[str, Any]) -> dict[str, int]:
        new, adopted = {}, 0
        for name, value in weights.items():
            i = self.index[name]
            aval, sharding = self.avals[i], self.shardings[i]
            if tuple(value.shape) != aval.shape:
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}; the engine's is {aval.shape}"
                )
            if (
                isinstance(value, jax.Array)
                and value.dtype == aval.dtype
                and (value.sharding.is_equivalent_to(sharding, value.ndim))
            ):
                new[i] = value  # the caller's buffers, as they are
                adopted += 1
            else:
                host = np.asarray(value).astype(aval.dtype, copy=False)
                new[i] = jax.make_array_from_callback(aval.shape, sharding, host.__getitem__)
        self._set_params(new)
        return {"adopted": adopted, "copied": len(new) - adopted}

    def _read(self, source: Any, partial: bool) -> int:
        """Read HF tensors from `source` through the loader's mapping, each parameter placed
        on the devices as it is built, then swapped in."""
        positions = {p: i for i, p in enumerate(self.paths)}
        new: dict[int, jax.Array] = {}

        def place(path: tuple, host: np.ndarray) -> None:
            i = positions[path]
            new[i] = jax.make_array_from_callback(host.shape, self.shardings[i], host.__getitem__)

        targets = dict(zip(self.paths, self.avals, strict=True))
        read_hf_params(
            source, self.runner.config, self._kv_replicas(), targets, place, partial=partial
        )
        self._set_params(new)
        return len(new)

    def _set_params(self, new: dict[int, jax.Array]) -> None:
        """Swap parameters in (the LM head too, which may be one of them)."""
        runner = self.runner
        params = list(runner.params)
        for i, value in new.items():
            params[i] = value
        runner.params = params
        runner.head = runner.model.logits_head

    def _check_awake(self) -> None:
        if "weights" in self.asleep:
            raise RuntimeError("the weights are asleep: wake_up(tags=['weights']) first")

    def _kv_replicas(self) -> int:
        return int(getattr(self.runner.model, "kv_replicas", 1))
