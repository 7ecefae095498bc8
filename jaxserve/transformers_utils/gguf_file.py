"""A GGUF file's metadata and tensors, read the way gguf-py's `GGUFReader` reads them, but in a
fraction of the time: gguf-py builds numpy views for every part of every string (a 49k-token
vocabulary and its merges take ~4 s); here string arrays are decoded in one pass over the
header's bytes and number arrays with `np.frombuffer` (~0.1 s). Tensors are views of one
read-only memory map, shaped as gguf-py shapes them (`data`: numpy order, quantized types as
bytes per row); gguf-py's constants and dequantization are used as they are.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF", version u32,
tensor count u64, metadata count u64; metadata (key string, value type u32, value); tensor infos
(name, n_dims u32, dims u64 innermost first, type u32, offset u64); padding to
`general.alignment` (32 by default); tensor data. Little-endian files only.
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> struct format of a scalar, and numpy dtype of an array of it
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
           10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
# Unquantized tensor types -> numpy dtype of their data (others are bytes per row).
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}  # fmt: skip


class GGUFField(NamedTuple):
    value: Any  # str, int, float, bool, or a list of them

    def contents(self) -> Any:
        return self.value


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # u64 dims, innermost first (as stored)
    data: np.ndarray  # numpy order; quantized: u8 [rows..., bytes per row]


class GGUFFile:
    """`fields` (key -> GGUFField) and `tensors` of the GGUF file at `path`; ValueError naming
    the file when it is not a GGUF file this can read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.mmap = np.memmap(self.path, mode="r")
        buf = memoryview(self.mmap)
        try:
            if bytes(buf[:4]) != _MAGIC:
                raise ValueError("GGUF magic invalid")
            version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (little-endian 2 or 3 supported)")
            self._buf, self._at = buf, 24
            self.fields = {}
            for _ in range(num_fields):
                key = self._string()
                self.fields[key] = GGUFField(self._value(self._u32()))
            infos = []
            for _ in range(num_tensors):
                name = self._string()
                n_dims = self._u32()
                dims = np.frombuffer(buf, "<u8", n_dims, self._at).copy()
                self._at += 8 * n_dims
                kind, offset = struct.unpack_from("<IQ", buf, self._at)
                self._at += 12
                infos.append((name, dims, GGMLQuantizationType(kind), offset))
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"truncated or corrupt GGUF header: {e}") from e
        finally:
            del buf
            self._buf = None
        alignment = int(self.fields.get("general.alignment", GGUFField(32)).value)
        data_start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)

    # ------------------------------------------------------------------ header parsing
    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._buf, self._at)
        self._at += 4
        return v

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._at)
        start = self._at + 8
        self._at = start + n
        if self._at > len(self._buf):
            raise IndexError("string past the end of the file")
        return str(self._buf[start : self._at], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind = self._u32()
            (count,) = struct.unpack_from("<Q", self._buf, self._at)
            self._at += 8
            if item_kind in _DTYPES:
                items = np.frombuffer(self._buf, _DTYPES[item_kind], count, self._at)
                self._at += items.nbytes
                return items.tolist()
            return [self._value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        (v,) = struct.unpack_from(_SCALARS[kind], self._buf, self._at)
        self._at += struct.calcsize(_SCALARS[kind])
        return v

    def _tensor(self, data_start: int, name, dims, kind, offset) -> GGUFTensor:
        n_elems = int(np.prod(dims))
        np_dims = tuple(int(d) for d in reversed(dims))
        at = data_start + offset
        if kind in _PLAIN:
            data = np.frombuffer(self.mmap, _PLAIN[kind], n_elems, at).reshape(np_dims)
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            n_bytes = n_elems * type_size // block_size
            data = np.frombuffer(self.mmap, np.uint8, n_bytes, at)
            data = data.reshape(quant_shape_to_byte_shape(np_dims, kind))
        return GGUFTensor(name, kind, dims, data)


def gguf_reader(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, parsed once per process while the file is unchanged: the
    engine config, the weights and the tokenizer all read it."""
    stat = os.stat(path)
    return _gguf_reader(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as e:  # struct errors, bad enum values, short files
        raise ValueError(f"corrupt or unreadable GGUF file {path}: {e}") from e
