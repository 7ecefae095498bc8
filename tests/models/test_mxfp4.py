"""MXFP4 (OCP microscaling: e2m1 values, an e8m0 scale per 32 inputs) kept packed, two values a
byte, and decoded inside the step's matmul: compressed-tensors' mxfp4-pack-quantized, as
llm-compressor's MXFP4A16 scheme writes it (tests/data/quantized/ct-mxfp4a16, made by
scripts/make_quantized_checkpoints.py in llm-compressor's own venv). The reference is
transformers' float32 logits of the checkpoint as compressed-tensors decompresses it, and that
decompressed q_proj weight, saved beside it by the same script."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.distributed.mesh import make_mesh
from jaxserve.layers.linear import E2M1
from jaxserve.models.loader import load_model
from tests.models.test_int4 import (
    assert_matches_recorded,
    edited,
    prompts_and_reference,
    q_proj_columns,
)
from tests.models.test_llama_parity import run_mixed_schedule

CHECKPOINT = Path(__file__).resolve().parents[1] / "data" / "quantized" / "ct-mxfp4a16"


def test_logits_match_transformers_and_weights_stay_packed():
    loaded = load_model(CHECKPOINT, dtype="float32")
    assert (loaded.config.quantization, loaded.config.quant_group) == ("mxfp4", 32)
    down = loaded.model.layers[0].mlp.down_proj  # 256 inputs -> 128 outputs
    assert down.kernel[...].dtype == down.scale[...].dtype == jnp.uint8
    assert down.kernel[...].shape == (128, 128) and down.scale[...].shape == (256 // 32, 128)
    assert down.offset is None
    assert_matches_recorded(loaded, CHECKPOINT)


def test_decoded_weights_equal_compressed_tensors_decompression():
    """Layer 0's q_proj decoded from the fused kernel (e2m1 code -> value, times 2 ** (e -
    127)) is exactly the weight compressed-tensors decompresses."""
    want = np.load(CHECKPOINT / "reference_dequant.npz")["model.layers.0.self_attn.q_proj.weight"]
    loaded = load_model(CHECKPOINT, dtype="float32")
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    k = np.asarray(qkv.kernel[...])
    codes = np.stack([k & 0xF, k >> 4], axis=1).reshape(-1, k.shape[1])
    scale = np.exp2(np.asarray(qkv.scale[...], np.float32) - 127)
    w = np.asarray(E2M1, np.float32)[codes] * np.repeat(scale, 32, axis=0)  # [in, fused out]
    np.testing.assert_array_equal(q_proj_columns(loaded, w).T, want)


def test_tp2_equals_tp1(cpu_devices):
    results = []
    for tp in (1, 2):
        loaded = load_model(CHECKPOINT, dtype="float32", mesh=make_mesh(tp, cpu_devices))
        kernel = loaded.model.layers[0].self_attn.o_proj.kernel[...]  # row-parallel, packed
        assert kernel.sharding.shard_shape(kernel.shape) == (64 // tp, 128)
        results.append(run_mixed_schedule(loaded, prompts_and_reference(CHECKPOINT)[0])[1])
    for seq in results[0]:
        np.testing.assert_allclose(results[1][seq], results[0][seq], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"group_size": 16}, "float 4-bit in groups of 32, not float 4-bit in groups of 16"),
        ({"type": "int"}, "float 4-bit in groups of 32, not int 4-bit"),
    ],
)
def test_unsupported_variants_are_named(tmp_path, change, message):
    bad = edited(CHECKPOINT, tmp_path,
                 lambda qc: qc["config_groups"]["group_0"]["weights"].update(change))  # fmt: skip
    with pytest.raises(ValueError, match=message):
        load_model(bad, dtype="float32")
