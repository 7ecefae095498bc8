"""jaxserve checkpoints (`jaxserve convert`): any model load_model reads, written as orbax
params beside its HF config, tokenizer and generation config files, so a later start
restores the arrays straight into their shardings (models/loader.py::_restore_orbax) instead
of reading, converting and dequantizing the source again."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
from flax import nnx

from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.models.loader import CHECKPOINT_MARKER, LoadedModel, load_model


def save_checkpoint(loaded: LoadedModel, dst: str | Path) -> Path:
    """Write `loaded` as a jaxserve checkpoint: orbax params, config.json, tokenizer files."""
    import orbax.checkpoint as ocp

    if loaded.model.kv_replicas > 1:  # checkpoints hold each KV head once
        raise ValueError(
            "cannot save a model loaded with KV heads replicated over "
            f"tensor_parallel_size={loaded.mesh.shape[TP_AXIS]}; load it with a tensor "
            f"parallel size dividing num_key_value_heads={loaded.config.num_kv_heads}"
        )
    dst = Path(dst).absolute()
    if (dst / "params").exists():
        raise FileExistsError(f"{dst / 'params'} already exists; choose an empty destination")
    dst.mkdir(parents=True, exist_ok=True)
    hf_config = loaded.config.hf_config
    if hasattr(hf_config, "to_transformers"):  # HFConfig, GGUFConfig: plain attributes
        hf_config = hf_config.to_transformers()
    else:
        hf_config = copy.deepcopy(hf_config)
    hf_config.dtype = np.dtype(loaded.config.dtype).name  # what `dtype="auto"` restores as
    hf_config.save_pretrained(dst)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(dst)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(dst)
    params = nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(dst / "params", params)
        ckpt.wait_until_finished()
    (dst / CHECKPOINT_MARKER).write_text(json.dumps({"format_version": 1}) + "\n")
    return dst


def convert(src: str | Path | None, dst: str | Path, *, dtype: str = "auto") -> Path:
    """`jaxserve convert`: load any supported model and save it as a jaxserve checkpoint."""
    loaded = load_model(src, dtype=dtype)
    return save_checkpoint(loaded, dst)
