"""vLLM's weight-transfer protocol with the transports a JAX trainer on the same machine (or
one sharing a filesystem) has: no NCCL group between a torch trainer and this engine.

  init_info {"backend": "shm"}                     tensors packed in POSIX shared memory
            {"backend": "dir", "path": DIR}        safetensors files under DIR
  update_info, shm: {"shm_name": NAME, "names": [...], "dtype_names": [...],
                     "shapes": [[...], ...], "offsets": [...] (optional: packed in order)}
              dir:  {"path": SUBDIR or FILE under DIR}

A transfer is start -> one or more updates (each staged on the host) -> finish, which hands
every staged tensor to the engine at once (engine/core_control.py). Names are HF's
(is_checkpoint_format, the default) or the engine's own.
"""

from __future__ import annotations

import contextlib
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

from jaxserve.models.weight_sources import SafetensorsSource

BACKENDS = ("shm", "dir")


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # bfloat16, float8 (jax's dependency)

    name = name.removeprefix("torch.")
    try:
        return np.dtype(getattr(ml_dtypes, name, None) or name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


class WeightTransfer:
    def __init__(self, init_info: dict):
        if not isinstance(init_info, dict) or init_info.get("backend") not in BACKENDS:
            raise ValueError(
                f"init_info.backend must be one of {list(BACKENDS)}, got {init_info!r}"
            )
        self.backend = init_info["backend"]
        self.root: Path | None = None
        if self.backend == "dir":
            if "path" not in init_info:
                raise ValueError("init_info for the 'dir' backend needs a path")
            self.root = Path(init_info["path"]).resolve()
            if not self.root.is_dir():
                raise ValueError(f"init_info.path {init_info['path']!r} is not a directory")
        self.staged: dict[str, np.ndarray] | None = None
        self.checkpoint_format = True

    def start(self, is_checkpoint_format: bool = True) -> None:
        self.staged, self.checkpoint_format = {}, bool(is_checkpoint_format)

    def stage(self, update_info: dict) -> int:
        """Copy the tensors `update_info` names to the host; returns how many."""
        if self.staged is None:
            raise ValueError("start_weight_update first")
        tensors = (
            self._read_shm(update_info) if self.backend == "shm" else self._read_dir(update_info)
        )
        self.staged.update(tensors)
        return len(tensors)

    def finish(self) -> tuple[dict[str, np.ndarray], bool]:
        if not self.staged:
            raise ValueError("no weights were staged since start_weight_update")
        staged, self.staged = self.staged, None
        return staged, self.checkpoint_format

    def _read_dir(self, info: dict) -> dict[str, np.ndarray]:
        if "path" not in info:
            raise ValueError("update_info for the 'dir' backend needs a path")
        path = (self.root / info["path"]).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"update_info.path {info['path']!r} is outside {self.root}")
        directory = path if path.is_dir() else path.parent
        source = SafetensorsSource(directory)
        names = source.names()
        if path.is_file():  # one file of the directory
            names = [n for n in names if source.file_of(n) == path]
        return {n: np.array(source.get(n)) for n in names}

    def _read_shm(self, info: dict) -> dict[str, np.ndarray]:
        try:
            names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
            shm_name = info["shm_name"]
        except KeyError as e:
            raise ValueError(f"update_info for the 'shm' backend needs {e.args[0]!r}") from None
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("update_info: names, dtype_names and shapes differ in length")
        try:
            shm = shared_memory.SharedMemory(name=shm_name)
        except FileNotFoundError:
            raise ValueError(f"no shared memory segment {shm_name!r}") from None
        # Attaching registers the segment with this process's resource tracker, which would
        # unlink it at exit (Python < 3.13): the trainer owns it.
        with contextlib.suppress(Exception):
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        try:
            out, offset = {}, 0
            offsets = info.get("offsets")
            for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
                dt = _dtype(dtype)
                count = int(np.prod(shape))
                start = int(offsets[i]) if offsets is not None else offset
                end = start + count * dt.itemsize
                if end > shm.size:
                    raise ValueError(f"{name} ends at byte {end}, past the segment's {shm.size}")
                view = np.frombuffer(shm.buf, dt, count, start).reshape(shape)
                out[name] = view.copy()
                del view
                offset = end
            return out
        finally:
            shm.close()
