"""`prompt_embeds` over HTTP as vLLM sends them: base64 of a `torch.save`d tensor [P, D].

torch is not a serving dependency, and a pickle from a request must never run code: the
archive's `data.pkl` is read by an unpickler that resolves only the names a saved tensor
uses (`torch._utils._rebuild_tensor_v2`, the typed storages, `collections.OrderedDict`)
and builds a numpy array from the archive's raw storage bytes; any other global is refused
with a 400. It is the allow-list torch's own `weights_only=True` loading applies.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import pickle
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

_STORAGES = {  # torch's typed storage names -> numpy dtypes (little-endian, as torch saves)
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64,
}  # fmt: skip
MAX_DIMS = 2


class _Storage:
    def __init__(self, dtype) -> None:
        self.dtype = np.dtype(dtype)


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2's result as a numpy array (a strided view, copied)."""
    if len(size) > MAX_DIMS or any(not isinstance(n, int) or n < 0 for n in (offset, *size)):
        raise ValueError(f"prompt_embeds: a tensor of size {list(size)} is not [positions, hidden]")
    itemsize = storage.itemsize
    end = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    if any(s < 0 for s in stride) or (all(size) and end > storage.size):
        raise ValueError("prompt_embeds: the tensor's strides run past its storage")
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=size, strides=[s * itemsize for s in stride], writeable=False
    )
    return np.array(view, dtype=np.float32)


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: dict[str, bytes]):
        super().__init__(io.BytesIO(data))
        self.storages = storages

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        raise pickle.UnpicklingError(f"prompt_embeds: {module}.{name} is not a tensor's part")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"prompt_embeds: unexpected persistent id {pid!r}")
        _, storage, key, _, numel = pid
        raw = self.storages.get(str(key))
        if not isinstance(storage, _Storage) or raw is None:
            raise pickle.UnpicklingError("prompt_embeds: a storage the archive does not hold")
        array = np.frombuffer(raw, dtype=storage.dtype)
        if array.size < numel:
            raise pickle.UnpicklingError("prompt_embeds: a storage shorter than it says")
        return array


def decode_prompt_embeds(encoded: str) -> np.ndarray:
    """base64(torch.save(tensor)) -> f32[P, D]; ValueError naming what is wrong."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(base64.b64decode(encoded, validate=True)))
        names = archive.namelist()
        pkl = next(n for n in names if n.endswith("/data.pkl"))
        root = pkl[: -len("data.pkl")]
        storages = {n[len(root) + 5 :]: archive.read(n) for n in names
                    if n.startswith(root + "data/")}  # fmt: skip
        tensor = _TensorUnpickler(archive.read(pkl), storages).load()
    except (binascii.Error, zipfile.BadZipFile, StopIteration, KeyError) as e:
        raise ValueError(f"prompt_embeds must be base64 of a torch.save'd tensor: {e!r}") from None
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
        raise ValueError(f"prompt_embeds: not a saved tensor ({e})") from None
    if not isinstance(tensor, np.ndarray):
        raise ValueError(f"prompt_embeds must hold one tensor, got {type(tensor).__name__}")
    return tensor
