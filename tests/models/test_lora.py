"""A PEFT adapter's tensors in the fused layout (models/lora.py): what it refuses."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.models.lora import load_adapter
from jaxserve.transformers_utils.config import read_model_config
from tests.helpers import make_tiny_hf


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return read_model_config(make_tiny_hf("llama", tmp_path_factory.mktemp("base")), "float32")


def adapter(path, tensors, r=4):
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    return str(path)


def test_slot_arrays_are_padded_and_scaled(config, tmp_path):
    a, b = np.ones((4, 64), np.float32), np.ones((64, 4), np.float32)
    prefix = "base_model.model.model.layers"
    path = adapter(
        tmp_path / "ok",
        {
            f"{prefix}.1.self_attn.q_proj.lora_A.weight": a,
            f"{prefix}.1.self_attn.q_proj.lora_B.weight": b,
        },
    )
    weights = load_adapter(path, config, max_rank=8)
    qa, qb = weights[1, "qkv_proj"]
    assert qa.shape == (64, 24) and qb.shape[0] == 24  # q, k, v parts of rank 8 each
    assert qa[:, :4].all() and not qa[:, 4:].any()  # q's rank 4, then zero padding
    assert set(np.unique(qb)) == {0.0, 2.0}  # B scaled by alpha / r
    assert not weights[0, "qkv_proj"][1].any()  # an untargeted layer stays zero


@pytest.mark.parametrize(
    "name, message",
    [
        ("base_model.model.lm_head.lora_A.weight", "not a LoRA weight of a projection"),
        ("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", "3-layer model"),
        ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", "q_proj is not under mlp"),
    ],
)
def test_foreign_tensors_are_refused(config, tmp_path, name, message):
    path = adapter(tmp_path / "bad", {name: np.ones((4, 64), np.float32)})
    with pytest.raises(ValueError, match=message):
        load_adapter(path, config, max_rank=8)


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "a, message",
    [
        (np.ones((4, 32), np.float32), r"lora_A.weight' has shape \(4, 32\), expected \(4, 64\)"),
        (np.full((4, 64), np.nan, np.float32), "lora_A.weight' holds NaN or infinite values"),
        (np.full((4, 64), np.inf, np.float16), "lora_A.weight' holds NaN or infinite values"),
        (np.ones((4, 64), np.int32), "lora_A.weight' is int32, not a floating-point type"),
    ],
)
def test_a_bad_tensor_is_refused_by_name(config, tmp_path, a, message):
    b = np.ones((64, 4), np.float32)
    path = adapter(tmp_path / "bad", {f"{Q}.lora_A.weight": a, f"{Q}.lora_B.weight": b})
    with pytest.raises(ValueError, match=f"{Q}.{message}"):
        load_adapter(path, config, max_rank=8)


def test_a_file_that_is_not_safetensors_is_refused(config, tmp_path):
    path = adapter(tmp_path / "garbage", {f"{Q}.lora_A.weight": np.ones((4, 64), np.float32)})
    (tmp_path / "garbage" / "adapter_model.safetensors").write_bytes(b"\x07" * 100)
    with pytest.raises(ValueError, match="corrupt safetensors file .*adapter_model.safetensors"):
        load_adapter(path, config, max_rank=8)
