"""FP8 checkpoints with 2-D block scales, kept in fp8 and scaled per block in the matmul:
transformers' FineGrainedFP8 layout (`quant_method: fp8`, `weight_block_size`, e4m3 `weight`
and `weight_scale_inv`, written here from the published layout, as the issue allows; the
reference is transformers loading it, in float32) and compressed-tensors' block strategy as
llm-compressor's FP8_BLOCK writes it (`weight_scale`, 128 x 128 blocks, and fp8 inputs
quantized per 128 dynamically: tests/data/quantized/ct-fp8-block, made by
scripts/make_quantized_checkpoints.py; the reference is transformers' float32 logits of it
through compressed-tensors, saved beside it)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.distributed.mesh import make_mesh
from jaxserve.distributed.sharding import validate_tp
from jaxserve.models.loader import load_model
from tests.helpers import hf_logits, make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule
from tests.models.test_quantization import LINEARS

BLOCK = [32, 32]  # [output rows, input columns]; 128 x 128 in real checkpoints
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip
PROMPTS = [list(range(3, 14)), list(range(40, 57))]


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (e4m3 values [out, in], f32 scales [out / 32, in / 32]): each block's
    largest magnitude maps to e4m3's 448, as DeepSeek's and Qwen's FP8 builds are made."""
    out, d_in = w.shape
    blocks = w.reshape(out // BLOCK[0], BLOCK[0], d_in // BLOCK[1], BLOCK[1])
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(out, d_in).astype(ml_dtypes.float8_e4m3fn)
    return q, scale.astype(np.float32)


def write_fp8(src, dst) -> None:
    """src's decoder linear weights in transformers' FineGrainedFP8 block layout."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    for name in list(tensors):
        if name.endswith(".weight") and any(f".{n}." in name for n in LINEARS):
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name])
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": BLOCK, "modules_to_not_convert": ["lm_head"],
    }  # fmt: skip
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-block")
    src = make_tiny_hf("llama", root / "src", **SHAPES)
    write_fp8(src, root / "hf")
    return root


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers' logits of the HF fp8 checkpoint, dequantized by its own loader."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints / "hf", dtype=torch.float32).eval()
    up = model.model.layers[0].mlp.up_proj.weight
    assert up.dtype == torch.float32  # dequantized: no fp8 kernels on CPU
    return model


def test_logits_match_transformers_and_kernels_stay_fp8(checkpoints, reference):
    loaded = load_model(checkpoints / "hf", dtype="float32")
    assert (loaded.config.quantization, loaded.config.quant_group) == ("fp8_block", 32)
    down = loaded.model.layers[0].mlp.down_proj
    assert down.kernel[...].dtype == jnp.float8_e4m3fn
    assert down.scale[...].shape == (256 // 32, 128)  # [in / 32, out]
    kernels = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    linears = [v.get_value() for p, v in nnx.to_flat_state(nnx.state(loaded.model))
               if p[-2] in kernels]  # fmt: skip
    as_fp32 = sum(4 * a.size for a in linears if a.dtype == jnp.float8_e4m3fn)
    assert sum(a.nbytes for a in linears) < as_fp32 / 3.5  # 1 byte a value, + 1/32 scales
    fed, got = run_mixed_schedule(loaded, PROMPTS)
    for seq, ids in fed.items():
        want = hf_logits(reference, ids)
        np.testing.assert_allclose(got[seq], want, atol=1e-3 * np.abs(want).max(), rtol=0)
        assert (got[seq].argmax(-1) == want.argmax(-1)).all()  # greedy: the same tokens


def test_llm_compressor_fp8_block_with_dynamic_fp8_inputs_matches_transformers():
    """llm-compressor's FP8_BLOCK: 128 x 128 weight blocks, and each linear's input quantized
    to e4m3 per 128 values of a token (dynamic), as compressed-tensors runs it: the logits
    match its (and not the weights-only model's: the inputs' rounding moves them ~0.4)."""
    from tests.models.test_int4 import DATA, assert_matches_recorded

    loaded = load_model(DATA / "ct-fp8-block", dtype="float32")
    c = loaded.config
    assert (c.quantization, c.quant_group) == ("fp8_block", 128)
    assert (c.input_quant, c.input_group) == ("fp8", 128)
    assert loaded.model.layers[0].mlp.down_proj.kernel[...].dtype == jnp.float8_e4m3fn
    weights_only = np.load(DATA / "ct-fp8-block" / "reference_logits_weight_only.npz")
    for i, mine in enumerate(assert_matches_recorded(loaded, DATA / "ct-fp8-block")):
        assert np.abs(mine - weights_only[f"prompt_{i}"]).max() > 0.05


def test_tp2_equals_tp1(checkpoints, cpu_devices):
    results = []
    for tp in (1, 2):
        loaded = load_model(checkpoints / "hf", dtype="float32", mesh=make_mesh(tp, cpu_devices))
        scale = loaded.model.layers[0].self_attn.o_proj.scale[...]  # row-parallel: whole groups
        assert scale.sharding.shard_shape(scale.shape) == (4 // tp, 128)
        results.append(run_mixed_schedule(loaded, PROMPTS)[1])
    for seq in results[0]:
        np.testing.assert_allclose(results[1][seq], results[0][seq], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="head_dim=128 into whole fp8_block groups of 32"):
        validate_tp(loaded.config, 8)  # o_proj's 128 input rows: 4 blocks for 8 devices


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
        ({"weight_block_size": [32]}, "weight_block_size \\[32\\] is not \\[rows, columns\\]"),
        ({"modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},
         "modules_to_not_convert 'model.layers.0.mlp.down_proj'"),
    ],
)  # fmt: skip
def test_unsupported_fp8_variants_are_named(checkpoints, tmp_path, change, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(checkpoints / "hf" / "model.safetensors")
    config = json.loads((checkpoints / "hf" / "config.json").read_text())
    config["quantization_config"].update(change)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(bad, dtype="float32")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dynamic": False}, "dynamic=False symmetric=True is not supported"),
        ({"strategy": "tensor"}, "strategy 'tensor' is not supported"),
        ({"num_bits": 4}, "float 4-bit inputs are not supported"),
    ],
)
def test_unsupported_input_quantization_is_named(tmp_path, change, message):
    from tests.models.test_int4 import DATA, edited

    group = lambda qc: qc["config_groups"]["group_0"]  # noqa: E731
    bad = edited(DATA / "ct-fp8-block", tmp_path,
                 lambda qc: group(qc)["input_activations"].update(change))  # fmt: skip
    with pytest.raises(ValueError, match=f"group 'group_0' input_activations: {message}"):
        load_model(bad, dtype="float32")
