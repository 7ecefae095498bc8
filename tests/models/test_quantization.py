"""Weight-only int8 / fp8 quantization at load: smaller kernels, nearly the same logits; and
checkpoints that come quantized (compressed-tensors)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.layers.linear import QUANT_DTYPES, quantize_kernel
from jaxserve.models.loader import load_model
from tests.helpers import hf_logits, hf_model, make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("quant"), intermediate_size=256)


@pytest.mark.parametrize(("quant", "tolerance"), [("int8", 0.01), ("fp8", 0.07)])
def test_quantize_kernel_per_output_channel(quant, tolerance):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 32)).astype(np.float32) * rng.uniform(0.01, 10, 32)  # channels
    q, scale = quantize_kernel(w, quant)
    assert q.dtype == {"int8": np.int8, "fp8": jnp.float8_e4m3fn}[quant] and scale.shape == (32,)
    back = q.astype(np.float32) * scale
    # relative to each channel's own range, whatever its magnitude
    assert np.max(np.abs(back - w) / np.abs(w).max(axis=0)) < tolerance


@pytest.mark.parametrize(("quant", "atol", "agree"), [("int8", 0.1, 0.9), ("fp8", 0.4, 0.75)])
def test_quantized_model_is_smaller_and_close(model_dir, quant, atol, agree):
    """Logits of a tiny random model (nearly flat: its argmax is fragile) within atol of full
    precision; fp8 e4m3 keeps 3 mantissa bits, int8 ~7."""
    full = load_model(model_dir, dtype="float32")
    small = load_model(model_dir, dtype="float32", quantization=quant)
    layer = small.model.layers[0]
    assert layer.mlp.gate_up_proj.kernel[...].dtype == jnp.dtype(
        {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[quant]
    )
    kernels = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}

    def linear_bytes(model):
        state = nnx.to_flat_state(nnx.state(model))
        return sum(v.get_value().nbytes for path, v in state if path[-2] in kernels)

    assert linear_bytes(small.model) < linear_bytes(full.model) / 3.5  # 1 byte vs 4, + scales
    prompts = [list(range(3, 14)), list(range(40, 57))]
    _, want = run_mixed_schedule(full, prompts)
    _, got = run_mixed_schedule(small, prompts)
    for seq in want:
        assert np.abs(got[seq] - want[seq]).max() < atol
        assert (got[seq].argmax(-1) == want[seq].argmax(-1)).mean() > agree


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _compressed_tensors_dir(src, dst, kind: str, strategy: str):
    """src's weights quantized as llm-compressor saves them (compressed-tensors: `weight` int8
    or fp8 [out, in] + `weight_scale`, per channel [out, 1] or per tensor) -> (dst, and a
    full-precision dir holding exactly the dequantized weights, for HF to run)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    deq = dict(tensors)
    top = 127.0 if kind == "int" else 448.0
    for name in list(tensors):
        if not name.endswith(".weight") or not any(f".{n}." in name for n in LINEARS):
            continue
        w = tensors.pop(name)
        amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max()
        scale = (amax / top).astype(np.float32)
        q = (
            np.rint(w / scale).astype(np.int8)
            if kind == "int"
            else (w / scale).astype(jnp.float8_e4m3fn)
        )
        tensors[name], tensors[name + "_scale"] = q, np.asarray(scale, np.float32)
        deq[name] = (q.astype(np.float32) * scale).astype(np.float32)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None,
            "weights": {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True},
        }},
        "ignore": ["lm_head"],
    }  # fmt: skip
    full = dst.parent / f"{dst.name}-dequantized"
    for d, ts in ((dst, tensors), (full, deq)):
        d.mkdir()
        save_file(ts, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(config if d == dst else {
            k: v for k, v in config.items() if k != "quantization_config"
        }))  # fmt: skip
    return dst, full


@pytest.mark.parametrize(("kind", "strategy"), [("int", "channel"), ("float", "tensor")])
def test_compressed_tensors_checkpoint_loads_quantized(model_dir, tmp_path, kind, strategy):
    """A pre-quantized checkpoint is read as it is (no re-quantization): its int8 / fp8 kernels
    and scales give HF's logits of the same dequantized weights."""
    ct, full = _compressed_tensors_dir(model_dir, tmp_path / "ct", kind, strategy)
    loaded = load_model(ct, dtype="float32")
    mode = "int8" if kind == "int" else "fp8"
    assert loaded.config.quantization == mode and loaded.config.prequantized
    qkv = loaded.model.layers[1].self_attn.qkv_proj
    assert qkv.kernel[...].dtype == jnp.dtype(QUANT_DTYPES[mode][0])
    ref = hf_model(str(full))
    prompts = [list(range(3, 14)), list(range(40, 57))]
    fed, got = run_mixed_schedule(loaded, prompts)
    for seq, ids in fed.items():
        np.testing.assert_allclose(got[seq], hf_logits(ref, ids), atol=2e-4)
    with pytest.raises(ValueError, match="conflicts with the checkpoint"):
        load_model(ct, dtype="float32", quantization="fp8" if mode == "int8" else "int8")


def test_unsupported_checkpoint_quantization_is_named(model_dir, tmp_path):
    ct, _ = _compressed_tensors_dir(model_dir, tmp_path / "ct", "int", "channel")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="int 8-bit group weights are not supported"):
        load_model(ct, dtype="float32")
    config["quantization_config"]["quant_method"] = "gptq"
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'gptq' is not supported"):
        load_model(ct, dtype="float32")
