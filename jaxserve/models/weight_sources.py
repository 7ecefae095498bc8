"""Read HF-named tensors as host numpy arrays from safetensors shards or a llama GGUF file.

Both sources memory-map their files and materialise one tensor at a time, so the loader's host
memory stays at about one (stacked) parameter beyond what has been placed on devices.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.layers.linear import GGUF_BLOCK
from jaxserve.transformers_utils.gguf_file import gguf_reader

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}  # fmt: skip


class SafetensorsSource:
    """All tensors of a HF checkpoint directory (`*.safetensors`, sharded with an index or not)."""

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise ValueError(f"corrupt safetensors index {index}: {e}") from e
            files = sorted({model_dir / f for f in weight_map.values()})
        if not files:
            raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
        self._where: dict[str, tuple[Path, dict]] = {}
        self._maps: dict[Path, np.memmap] = {}
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"weight file {f} (listed in {index.name}) is missing")
            header, data_start = _read_safetensors_header(f)
            self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r", offset=data_start)
            for name, info in header.items():
                self._where[name] = (f, info)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> Path:
        return self._where[name][0]

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            files = ", ".join(sorted({str(f) for f, _ in self._where.values()}))
            raise KeyError(f"tensor {name!r} not found in {files}")
        f, info = self._where[name]
        begin, end = info["data_offsets"]
        raw = self._maps[f][begin:end]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _read_safetensors_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
            itemsize = np.dtype(_ST_DTYPES[info["dtype"]]).itemsize
            if end - begin != itemsize * int(np.prod(info["shape"])) or 8 + n + end > size:
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt safetensors file {path}: {e}") from e
    return header, 8 + n


# HF tensor name -> llama.cpp GGUF tensor name.
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


class GGUFSource:
    """Dequantised float32 tensors of a llama-architecture GGUF file, under their HF names.

    llama.cpp's converter permutes the rows of attn_q / attn_k (interleaved rotary pairs); this
    undoes it so the weights match HF's rotate-half layout.
    """

    def __init__(self, path: Path):
        self.reader = gguf_reader(path)  # transformers_utils/gguf_file.py, parsed once
        self.path = path
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported (llama only)")
        self.num_heads = int(self.field("llama.attention.head_count"))
        self.num_kv_heads = int(self.field("llama.attention.head_count_kv") or self.num_heads)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.tensor_names = frozenset(self._tensors)

    def field(self, key: str):
        f = self.reader.get_field(key)
        return None if f is None else f.contents()

    def _gguf_name(self, name: str) -> str:
        if name in _GGUF_GLOBAL:
            return _GGUF_GLOBAL[name]
        m = _LAYER_RE.fullmatch(name)
        if not m or m.group(2) not in _GGUF_LAYER:
            raise KeyError(f"tensor {name!r} has no GGUF counterpart")
        return f"blk.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"

    def __contains__(self, name: str) -> bool:
        try:
            return self._gguf_name(name) in self._tensors
        except KeyError:
            return False

    def get_blocks(self, name: str) -> tuple[np.ndarray, ...]:
        """A quantized tensor as it is stored: (q int8 [out, in], d, m float32 [out, in / 16]),
        rows unpermuted like `get`'s (`gguf_blocks`)."""
        t = self._tensors[self._gguf_name(name)]
        num_in = int(t.shape[0])  # GGUF lists dims innermost first
        parts = gguf_blocks(t.data, t.tensor_type.name, num_in)
        if name.endswith("q_proj.weight"):
            parts = tuple(_unpermute(p, self.num_heads) for p in parts)
        elif name.endswith("k_proj.weight"):
            parts = tuple(_unpermute(p, self.num_kv_heads) for p in parts)
        return parts

    def get(self, name: str) -> np.ndarray:
        import gguf

        gname = self._gguf_name(name)
        if gname not in self._tensors:
            raise KeyError(f"tensor {gname!r} (for {name!r}) not found in {self.path}")
        t = self._tensors[gname]
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy order: [out, in]
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if gname.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, self.num_heads)
        elif gname.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, self.num_kv_heads)
        return w


# llama.cpp's block formats kept quantized (`--quantization gguf`), all w = d * q + m per run
# of GGUF_BLOCK input values. Legacy 32-value blocks: name -> (has a min, has 5th bits, offset
# subtracted from the stored q); and the K-quants Q4_K (256-value super-blocks of 32-value
# sub-blocks with 6-bit scales and mins) and Q6_K (16-value sub-blocks with int8 scales), which
# is why the runs are 16 long (a 32-value block's d and m are repeated).
_GGUF_LEGACY = {
    "Q8_0": (False, False, 0),
    "Q4_0": (False, False, 8),
    "Q4_1": (True, False, 0),
    "Q5_0": (False, True, 16),
    "Q5_1": (True, True, 0),
}
GGUF_KEPT = (*_GGUF_LEGACY, "Q4_K", "Q6_K")


def gguf_blocks(data: np.ndarray, qtype: str, num_in: int) -> tuple[np.ndarray, ...]:
    """One GGUF tensor's raw blocks (uint8 [out, bytes per row]) -> (q int8 [out, in],
    d float32 [out, in / 16], m float32 [out, in / 16]): weight = d * q + m per 16 inputs,
    exactly the values llama.cpp's (and gguf-py's) dequantisation gives."""
    if qtype not in GGUF_KEPT:
        raise ValueError(
            f"{qtype} blocks cannot stay quantized (supported: {', '.join(GGUF_KEPT)}); load "
            "without --quantization gguf"
        )
    rows = data.shape[0]
    if qtype == "Q4_K":
        q, d, m = _q4_k(np.ascontiguousarray(data).reshape(rows, num_in // 256, -1))
    elif qtype == "Q6_K":
        q, d, m = _q6_k(np.ascontiguousarray(data).reshape(rows, num_in // 256, -1))
    else:
        q, d, m = _legacy(np.ascontiguousarray(data).reshape(rows, num_in // 32, -1), qtype)
    runs = num_in // GGUF_BLOCK
    d, m = (np.repeat(x.reshape(rows, -1), runs // x.reshape(rows, -1).shape[1], 1) for x in (d, m))
    return q.reshape(rows, num_in), d, m


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte `at` of every block [..., bytes] -> f32 [...]."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _legacy(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, ...]:
    """[rows, nb, bytes] 32-value blocks: f16 d, f16 m (formats with a min), u32 5th bits
    (5-bit formats), then 32 int8 (Q8_0) or 16 bytes of nibbles, element j in the low nibble
    of byte j and element j + 16 in its high nibble -> q [rows, nb, 32], d, m [rows, nb]."""
    has_min, five_bit, offset = _GGUF_LEGACY[qtype]
    d, pos = _f16(blocks, 0), 2
    m = np.zeros_like(d)
    if has_min:
        m, pos = _f16(blocks, 2), 4
    if qtype == "Q8_0":
        return blocks[..., pos:].copy().view(np.int8), d, m
    if five_bit:
        qh = blocks[..., pos : pos + 4].copy().view(np.uint32)  # [rows, nb, 1]
        pos += 4
    qs = blocks[..., pos : pos + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32]
    if five_bit:
        q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    return (q.astype(np.int16) - offset).astype(np.int8), d, m


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """[rows, nb, 144] super-blocks: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for
    8 sub-blocks, 128 bytes of nibbles (per 64 values: 32 bytes, low nibbles first) ->
    q [rows, nb, 256], d, m [rows, nb, 8] (w = d * sc * q - dmin * mn)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sm = blocks[..., 4:16].astype(np.uint8)
    low = np.concatenate([sm[..., 0:4] & 63, sm[..., 8:12] & 0x0F | (sm[..., 0:4] >> 6) << 4], -1)
    mins = np.concatenate([sm[..., 4:8] & 63, sm[..., 8:12] >> 4 | (sm[..., 4:8] >> 6) << 4], -1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*blocks.shape[:2], 256)
    scale = d[..., None] * low.astype(np.float32)
    return q.astype(np.int8), scale, -(dmin[..., None] * mins.astype(np.float32))


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """[rows, nb, 210] super-blocks: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
    scales (one per 16 values), f16 d -> q [rows, nb, 256], d, m [rows, nb, 16]."""
    shape = blocks.shape[:2]
    ql = blocks[..., :128].reshape(*shape, 2, 2, 32)  # [half, 32-byte row, l]
    qh = blocks[..., 128:192].reshape(*shape, 2, 1, 32)  # [half, ., l]
    low = np.stack([ql & 0x0F, ql >> 4], axis=-3)  # [half, nibble, row, l]: value 64n + 32r + l
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-3).reshape(*shape, 2, 2, 2, 32)
    q = (low | high << 4).astype(np.int16) - 32  # value 128h + 64 nibble + 32 row + l
    scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)[..., None] * scales
    return q.reshape(*shape, 256).astype(np.int8), d, np.zeros_like(d)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (pairs, 2) -> (2, pairs)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
