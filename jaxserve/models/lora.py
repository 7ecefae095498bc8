"""A PEFT LoRA adapter's weights in the layout of this engine's fused projections.

PEFT stores per targeted module `...layers.{l}.self_attn.q_proj.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]. A slot of a fused projection holds its parts side by side, each
padded to the engine's rank R (--max-lora-rank): qkv_proj's A [D, 3R] is q's, k's, v's A^T;
its B [3R, width] is block-diagonal, q's B^T in rows 0..R-1 under q's output columns, and so
on, the columns ordered as `fuse_qkv` orders the fused kernel's (KV heads replicated as the
kernel's are). gate_up_proj the same with `fuse_gate_up`'s interleaving; o_proj and down_proj
are one part. A part the adapter does not target stays zero. The adapter's scaling (alpha / r,
alpha / sqrt(r) with rsLoRA) is folded into B.
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.lora_request import read_adapter_config
from jaxserve.models.llama import fuse_gate_up, fuse_qkv
from jaxserve.models.weight_sources import SafetensorsSource

# fused projection -> (its module, the PEFT modules it holds, in order)
LORA_PROJECTIONS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
_NAME = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FUSED_OF = {part: fused for fused, (_, parts) in LORA_PROJECTIONS.items() for part in parts}
# the dtypes an adapter's tensors may have (they are read as float32)
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))

# (layer, fused projection) -> (A [in, parts * R], B [parts * R, out]), one slot's arrays
AdapterWeights = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def projection_dims(config: ModelConfig, kv_replicas: int) -> dict[str, tuple[int, int]]:
    """Each fused projection's (in, out) as the model stores it."""
    d, hd, f = config.hidden_size, config.head_dim, config.intermediate_size
    heads = config.num_kv_heads * kv_replicas
    width = heads * (config.num_heads // heads + 2) * hd
    return {
        "qkv_proj": (d, width),
        "o_proj": (config.num_heads * hd, d),
        "gate_up_proj": (d, 2 * f),
        "down_proj": (f, d),
    }


def load_adapter(
    path: str, config: ModelConfig, *, max_rank: int, kv_replicas: int = 1, dtype=np.float32
) -> AdapterWeights:
    """The adapter at `path` as one slot's arrays for every (layer, fused projection)
    (FileNotFoundError / ValueError as `read_adapter_config`, and ValueError naming the
    tensor for one that names no projection of this model, has the wrong shape, is not
    floating point or holds a NaN or an infinity; a file that is no safetensors file)."""
    adapter = read_adapter_config(path, max_rank)
    source = SafetensorsSource(Path(path))  # ValueError for a corrupt file
    dims = projection_dims(config, kv_replicas)
    r = adapter.r
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name in source.names():
        layer, part, ab = _lora_weight(name, path, config)
        d_in = dims[_FUSED_OF[part]][0]
        want = (r, d_in) if ab == "A" else (_part_out(part, config), r)
        tensor = source.get(name)
        if tensor.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"adapter {path!r}: tensor {name!r} is {tensor.dtype}, not a "
                "floating-point type (F16, BF16, F32, F64)"
            )
        if tensor.shape != want:
            raise ValueError(
                f"adapter {path!r}: tensor {name!r} has shape {tensor.shape}, expected {want} "
                f"(rank {r}; this model's {part} takes {d_in} inputs to {_part_out(part, config)}"
                " outputs)"
            )
        tensor = np.asarray(tensor, np.float32)
        if not np.isfinite(tensor).all():
            raise ValueError(f"adapter {path!r}: tensor {name!r} holds NaN or infinite values")
        found.setdefault((layer, part), {})[ab] = tensor
    out: AdapterWeights = {}
    for layer in range(config.num_layers):
        for fused, (_, parts) in LORA_PROJECTIONS.items():
            d_in, d_out = dims[fused]
            a = np.zeros((d_in, len(parts) * max_rank), np.float32)
            bs = []  # per part: its B^T [out_part, parts * R], zero outside its own rows
            for i, part in enumerate(parts):
                ab = found.get((layer, part))
                b = np.zeros((_part_out(part, config), len(parts) * max_rank), np.float32)
                if ab is not None:
                    if set(ab) != {"A", "B"}:
                        raise ValueError(
                            f"adapter {path!r}: layer {layer} {part} lacks lora_A or lora_B"
                        )
                    a[:, i * max_rank : i * max_rank + r] = ab["A"].T
                    b[:, i * max_rank : i * max_rank + r] = ab["B"] * adapter.scaling
                bs.append(b)
            if fused == "qkv_proj":
                b_fused = fuse_qkv(*bs, config=config, kv_replicas=kv_replicas)
            elif fused == "gate_up_proj":
                b_fused = fuse_gate_up(*bs)
            else:
                b_fused = bs[0]
            out[layer, fused] = (a.astype(dtype), np.ascontiguousarray(b_fused.T).astype(dtype))
    return out


def _lora_weight(name: str, path: str, config: ModelConfig) -> tuple[int, str, str]:
    """A PEFT tensor name -> (layer, PEFT module, "A" | "B"); ValueError for a name that is
    no LoRA weight of a projection of this model."""
    m = _NAME.search(name)
    if m is None or int(m[1]) >= config.num_layers or m[3] not in _FUSED_OF:
        raise ValueError(
            f"adapter {path!r}: tensor {name!r} is not a LoRA weight of a "
            f"projection of this {config.num_layers}-layer model"
        )
    if LORA_PROJECTIONS[_FUSED_OF[m[3]]][0] != m[2]:
        raise ValueError(f"adapter {path!r}: tensor {name!r}: {m[3]} is not under {m[2]}")
    return int(m[1]), m[3], m[4]


def _part_out(part: str, config: ModelConfig) -> int:
    """A PEFT module's output size (HF's layout)."""
    hd = config.head_dim
    return {
        "q_proj": config.num_heads * hd,
        "k_proj": config.num_kv_heads * hd,
        "v_proj": config.num_kv_heads * hd,
        "o_proj": config.hidden_size,
        "gate_proj": config.intermediate_size,
        "up_proj": config.intermediate_size,
        "down_proj": config.hidden_size,
    }[part]
