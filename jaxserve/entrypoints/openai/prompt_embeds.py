"""`prompt_embeds` over HTTP as vLLM sends them: base64 of a `torch.save`d tensor [P, D].

torch is not a serving dependency, and a pickle from a request must never run code: the
archive's `data.pkl` is read by an unpickler that resolves only the names a saved tensor
uses (`torch._utils._rebuild_tensor_v2`, the typed storages, `collections.OrderedDict`);
any other global is refused with a 400. It is the allow-list torch's own `weights_only=True`
loading applies.

Nothing is allocated for more than the server can use: the base64 text is bounded before it
is decoded, the archive may hold few entries, each stored as torch.save writes them (no
compression, so nothing inflates), and the tensor the pickle declares (shape, strides, dtype,
storage) is checked against [max_model_len, hidden size] before its storage's bytes are read.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import pickle
import pickletools
import reprlib
import zipfile
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

_STORAGES = {  # torch's typed storage names -> numpy dtypes (little-endian, as torch saves)
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64,
}
_MAX_ITEMSIZE = 8  # DoubleStorage's
MAX_PICKLE_BYTES = 16 * 1024  # a saved tensor's data.pkl is about 150 bytes
MAX_ENTRIES = 64  # torch.save writes 7
_ARCHIVE_OVERHEAD = MAX_PICKLE_BYTES + 64 * 1024  # the other entries, headers, directory
_CENTRAL_DIRECTORY_ENTRY = b"PK\x01\x02"  # each zip entry's directory record starts so
_COMPRESSIONS = {8: "deflate", 9: "deflate64", 12: "bzip2", 14: "lzma", 93: "zstandard"}


def max_encoded_length(max_positions: int, hidden_size: int) -> int:
    """The longest base64 text an archive of a [max_positions, hidden_size] tensor can be."""
    raw = max_positions * hidden_size * _MAX_ITEMSIZE + _ARCHIVE_OVERHEAD
    return 4 * (raw // 3 + 1)


class _Storage:  # a typed storage class the pickle names: its dtype
    def __init__(self, dtype) -> None:
        self.dtype = np.dtype(dtype)


class _StorageRef(NamedTuple):  # a persistent id: archive entry data/<key>, numel elements
    dtype: np.dtype
    key: str
    numel: int


class _TensorRef(NamedTuple):  # _rebuild_tensor_v2's arguments: nothing read yet
    storage: _StorageRef
    offset: Any
    size: Any
    stride: Any


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise pickle.UnpicklingError("a tensor built on something that is not a storage")
    return _TensorRef(storage, offset, size, stride)


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        raise pickle.UnpicklingError(f"prompt_embeds: {module}.{name} is not a tensor's part")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {reprlib.repr(pid)}")
        _, storage, key, _, numel = pid
        if not (isinstance(storage, _Storage) and isinstance(key, str) and _is_int(numel)):
            raise pickle.UnpicklingError(f"not a storage: {reprlib.repr(pid)}")
        return _StorageRef(storage.dtype, key, numel)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(values: Any, n: int) -> bool:
    return isinstance(values, tuple | list) and len(values) == n and all(map(_is_int, values))


def _read(archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int) -> bytes:
    """An entry's bytes, which must be exactly `size`, stored; never more is read."""
    if info.compress_size != info.file_size or info.file_size != size:
        raise ValueError(
            f"prompt_embeds: archive entry {info.filename!r} declares {info.file_size} bytes "
            f"({info.compress_size} stored), {size} expected"
        )
    with archive.open(info) as entry:
        data = entry.read(size)
    if len(data) != size:
        raise ValueError(f"prompt_embeds: archive entry {info.filename!r} is truncated")
    return data


def _open(data: bytes) -> zipfile.ZipFile:
    """The archive, refused when it has many entries or any entry not as torch.save writes
    it: compressed (a bomb inflates; torch stores) or encrypted."""
    # zipfile builds an object per directory record; each begins with this signature
    if data.count(_CENTRAL_DIRECTORY_ENTRY) > MAX_ENTRIES:
        raise ValueError(f"prompt_embeds: an archive of more than {MAX_ENTRIES} entries")
    archive = zipfile.ZipFile(io.BytesIO(data))
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            method = _COMPRESSIONS.get(info.compress_type, f"method {info.compress_type}")
            raise ValueError(
                f"prompt_embeds: archive entry {info.filename!r} is {method}-"
                "compressed; torch.save stores entries uncompressed"
            )
        if info.flag_bits & 0x1:
            raise ValueError(f"prompt_embeds: archive entry {info.filename!r} is encrypted")
    return archive


def _scan(data: bytes) -> None:
    """Refuse what makes pickle allocate for a number the data declares, before it runs:
    a bytes or str longer than the data left (allocated before it is read; the pure-Python
    scan reads only what is there), a memo index past the data (the memo grows to it)."""
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg >= len(data):
            raise ValueError(f"memo index {arg} in a pickle of {len(data)} bytes")


def _unpickle(archive: zipfile.ZipFile) -> tuple[_TensorRef, str]:
    """data.pkl's tensor, its storage not read, and the archive's root folder."""
    info = next((i for i in archive.infolist() if i.filename.endswith("/data.pkl")), None)
    if info is None:
        raise ValueError("prompt_embeds must be base64 of a torch.save'd tensor: no data.pkl")
    if info.file_size > MAX_PICKLE_BYTES:
        raise ValueError(
            f"prompt_embeds: data.pkl of {info.file_size} bytes (a tensor's is "
            f"under {MAX_PICKLE_BYTES})"
        )
    data = _read(archive, info, info.file_size)
    try:
        _scan(data)
        tensor = _TensorUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # anything a hostile pickle provokes is a bad request
        raise ValueError(f"prompt_embeds: not a saved tensor ({e})") from None
    if not isinstance(tensor, _TensorRef):
        raise ValueError(f"prompt_embeds must hold one tensor, got {type(tensor).__name__}")
    return tensor, info.filename[: -len("data.pkl")]


def _check(tensor: _TensorRef, hidden_size: int, max_positions: int) -> None:
    """Refuse a tensor that is not [1..max_positions, hidden_size], or whose view repeats
    or overlaps elements (zero, negative or crossing strides), or runs past its storage."""
    storage, offset, size, stride = tensor
    if not (_ints(size, 2) and size[1] == hidden_size and 0 < size[0] <= max_positions):
        raise ValueError(
            f"prompt_embeds must be [positions, {hidden_size}] with 1 to {max_positions} "
            f"positions (max_model_len), got shape {reprlib.repr(size)}"
        )
    if not (_ints(stride, 2) and min(stride) >= 0 and _is_int(offset) and offset >= 0):
        raise ValueError(
            f"prompt_embeds: strides {reprlib.repr(stride)} and offset "
            f"{reprlib.repr(offset)} are not a tensor's"
        )
    inner = 1  # the elements one step of the next larger stride must clear
    for s, n in sorted((s, n) for n, s in zip(size, stride, strict=True) if n > 1):
        if s < inner:
            raise ValueError(
                f"prompt_embeds: strides {list(stride)} of shape {list(size)} "
                "repeat or overlap elements"
            )
        inner = s * n
    if not 0 < storage.numel <= max_positions * hidden_size:
        raise ValueError(
            f"prompt_embeds: a storage of {storage.numel} elements (at most "
            f"max_model_len x hidden size = {max_positions * hidden_size})"
        )
    end = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    if end > storage.numel:
        raise ValueError(
            f"prompt_embeds: shape {list(size)}, strides {list(stride)} at offset "
            f"{offset} run past a storage of {storage.numel} elements"
        )


def decode_prompt_embeds(encoded: str, *, hidden_size: int, max_positions: int) -> np.ndarray:
    """base64(torch.save(tensor [P, hidden_size])) -> f32[P, hidden_size], 0 < P <=
    max_positions; ValueError naming what is wrong, before allocating for anything larger."""
    limit = max_encoded_length(max_positions, hidden_size)
    if len(encoded) > limit:
        raise ValueError(
            f"prompt_embeds of {len(encoded)} base64 characters: a [{max_positions}"
            f", {hidden_size}] tensor's archive takes at most {limit}"
        )
    try:
        archive = _open(base64.b64decode(encoded, validate=True))
        tensor, root = _unpickle(archive)
        _check(tensor, hidden_size, max_positions)
        storage = tensor.storage
        info = archive.getinfo(f"{root}data/{storage.key}")
        raw = _read(archive, info, storage.numel * storage.dtype.itemsize)
    except binascii.Error as e:
        raise ValueError(f"prompt_embeds must be base64 of a torch.save'd tensor: {e}") from None
    except (zipfile.BadZipFile, KeyError, EOFError, OSError, NotImplementedError) as e:
        raise ValueError(f"prompt_embeds must be base64 of a torch.save'd tensor: {e!r}") from None
    view = np.lib.stride_tricks.as_strided(
        np.frombuffer(raw, dtype=storage.dtype)[tensor.offset :],
        shape=tensor.size,
        strides=[s * storage.dtype.itemsize for s in tensor.stride],
        writeable=False,
    )
    return np.array(view, dtype=np.float32)
