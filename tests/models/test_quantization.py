"""Weight-only int8 / fp8 quantization at load: smaller kernels, HF's greedy tokens and logits
on the same dequantized weights; and checkpoints that come quantized (compressed-tensors)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx, traverse_util

from jaxserve.layers.linear import QUANT_DTYPES, quantize_kernel
from jaxserve.models.loader import load_model
from tests.greedy_parity import assert_greedy_matches_hf
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


def dequantized_hf(loaded, model_dir):
    """HF's model of model_dir holding the weights a quantized jaxserve model computes with:
    each int8 / fp8 kernel and its per-output-channel scale, as jaxserve holds them,
    dequantized in torch (w = q * scale, the format's definition) and split back into the HF
    tensors it was fused from (a column's source found by building the parameter from tags)."""
    from transformers import AutoModelForCausalLM

    from jaxserve.models.registry import get_model_class

    config = loaded.config
    model_cls = get_model_class(config.architecture)
    replicas = loaded.model.num_cache_kv_heads // config.num_kv_heads
    params = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(loaded.model)))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = ref.state_dict()
    replaced = set()
    for path, kernel in params.items():
        if path[-1] != "kernel" or (*path[:-1], "scale") not in params:
            continue
        q = np.array(kernel)  # [in, out] int8 or float8_e4m3fn
        if q.dtype == jnp.float8_e4m3fn:  # as torch's own e4m3, bit for bit
            values = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        else:
            values = torch.from_numpy(q)
        scale = torch.from_numpy(np.array(params[(*path[:-1], "scale")]))  # [out]
        w = values.to(torch.float32) * scale  # [in, out]
        weight = model_cls.hf_weight(config, path, replicas)
        tags = [np.arange(state[n].shape[0], dtype=np.float64)[:, None] + (j << 20)
                for j, n in enumerate(weight.names)]  # fmt: skip
        source = weight.build(*tags).reshape(-1).astype(np.int64)  # [out]: (j << 20) + row
        for j, name in enumerate(weight.names):
            cols = np.flatnonzero(source >> 20 == j)
            rows = source[cols] & ((1 << 20) - 1)
            assert sorted(set(rows.tolist())) == list(range(state[name].shape[0])), name
            state[name][torch.from_numpy(rows)] = w[:, torch.from_numpy(cols)].T
            replaced.add(name)
    assert replaced == {n for n in state if any(f".{s}." in n for s in LINEARS)}
    ref.load_state_dict(state)
    return ref


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_quantized_model_is_smaller_and_matches_hf_on_its_weights(model_dir, quant):
    """--quantization int8 / fp8: the decoder layers' kernels take 1 byte a value (+ one scale
    per output channel), and greedy decoding gives HF's tokens and log-probabilities on the
    same dequantized weights."""
    loaded = load_model(model_dir, dtype="float32", quantization=quant)
    layer = loaded.model.layers[0]
    assert layer.mlp.gate_up_proj.kernel[...].dtype == jnp.dtype(QUANT_DTYPES[quant][0])
    kernels = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    state = nnx.to_flat_state(nnx.state(loaded.model))
    linears = [v.get_value() for path, v in state if path[-2] in kernels]
    as_fp32 = sum(4 * a.size for a in linears if a.ndim == 2)
    assert sum(a.nbytes for a in linears) < as_fp32 / 3.5  # 1 byte vs 4, + scales

    ref = dequantized_hf(loaded, str(model_dir))
    before = hf_model(str(model_dir)).model.layers[0].mlp.up_proj.weight  # unquantized
    assert not torch.equal(ref.model.layers[0].mlp.up_proj.weight, before)
    # The same weights on both sides: fp32 rounding apart (2e-6 measured; HF on the weights
    # before quantization is 0.07 (int8) and 0.25 (fp8) away), so much tighter than 1e-2.
    prompts = [list(range(3, 14)), list(range(40, 57))]
    assert_greedy_matches_hf(loaded, ref, prompts, new_tokens=8, atol=1e-4)


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
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        load_model(ct, dtype="float32")
