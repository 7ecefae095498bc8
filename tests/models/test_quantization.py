"""Weight-only int8 / fp8 quantization at load: smaller kernels, nearly the same logits."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.layers.linear import quantize_kernel
from jaxserve.models.loader import load_model
from tests.helpers import make_tiny_hf
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
