"""The KV cache in fp8 (--kv-cache-dtype fp8): scaled, saturated writes, checkpoint scales, and
a whole model and engine running over it."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.entrypoints.llm import LLM
from jaxserve.layers.attention import write_kv
from jaxserve.models.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.model_runner import ModelRunner
from tests.helpers import PagedSequences, make_tiny_hf

E4M3 = ml_dtypes.float8_e4m3fn


def test_fp8_write_divides_by_the_scale_and_saturates():
    cache = jnp.zeros((2, 4, 1, 2), jnp.float8_e4m3fn)
    new = jnp.array([[[1.0, -2000.0]], [[900.0, 3.0]]])  # [T=2, Hkv=1, D=2]
    slots = jnp.array([1, -1])  # the second is padding: dropped
    out = np.asarray(write_kv(cache, new, slots, scale=1.0), np.float32)
    np.testing.assert_array_equal(out[0, 1, 0], [1.0, -448.0])  # saturated, not NaN
    assert not out[1].any() and not out[0, 0].any()
    out = np.asarray(write_kv(cache, new, jnp.array([5, 6]), scale=8.0), np.float32)
    np.testing.assert_array_equal(out[1, 1, 0], [0.125, -256.0])  # -250: e4m3's nearest
    np.testing.assert_array_equal(out[1, 2, 0], [112.0, 0.375])  # 900 / 8 = 112.5 -> 112


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("llama"))


def _logits(loaded, kv_dtype=None) -> np.ndarray:
    """Log-probabilities of a 21-token prefill (two chunks) and 3 decodes: [24, V]."""
    seqs = PagedSequences(loaded, kv_dtype=kv_dtype)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 256, 24).tolist()
    out = [seqs.step({0: prompt[:13]})[0], seqs.step({0: prompt[13:21]})[0]]
    out += [seqs.step({0: [t]})[0] for t in prompt[21:]]
    logits = np.concatenate(out)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _kl(full: np.ndarray, other: np.ndarray) -> float:
    """The largest KL(full || other) over the rows."""
    return float((np.exp(full) * (full - other)).sum(-1).max())


def test_fp8_cache_stays_close_to_full_precision(tiny_dir):
    loaded = load_model(str(tiny_dir), dtype="float32", load_tokenizer=False)
    full, fp8 = _logits(loaded), _logits(loaded, jnp.float8_e4m3fn)
    assert np.abs(fp8 - full).max() > 0  # the cache really is fp8 (3 mantissa bits) ...
    assert _kl(full, fp8) < 0.005  # ... and the distributions stay close (0.0011 measured)
    assert (fp8.argmax(-1) == full.argmax(-1)).mean() >= 0.9


def test_checkpoint_kv_scales_are_read_and_keep_large_values(tiny_dir, tmp_path):
    """V scaled up 1000x (o_proj down as much: the same model) overflows e4m3 unless the
    checkpoint's v_scale brings it back into range."""
    tensors = load_file(tiny_dir / "model.safetensors")
    for i in range(3):
        tensors[f"model.layers.{i}.self_attn.v_proj.weight"] *= 1000
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"] /= 1000
    (tmp_path / "plain").mkdir()
    (tmp_path / "scaled").mkdir()
    for name in ("config.json", "generation_config.json"):
        for d in ("plain", "scaled"):
            (tmp_path / d / name).write_bytes((tiny_dir / name).read_bytes())
    save_file(tensors, tmp_path / "plain" / "model.safetensors")
    for i in range(3):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(1.0, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(64.0, np.float32)
    save_file(tensors, tmp_path / "scaled" / "model.safetensors")

    plain = load_model(str(tmp_path / "plain"), dtype="float32", load_tokenizer=False)
    scaled = load_model(str(tmp_path / "scaled"), dtype="float32", load_tokenizer=False)
    assert [layer.self_attn.v_scale for layer in scaled.model.layers] == [64.0] * 3
    assert plain.model.layers[0].self_attn.v_scale == 1.0
    full = _logits(plain)  # a float32 cache: no scales used
    good = _kl(full, _logits(scaled, jnp.float8_e4m3fn))
    saturated = _kl(full, _logits(plain, jnp.float8_e4m3fn))
    assert good < 0.005 and saturated > 10 * good, (good, saturated)


def test_fp8_cache_takes_a_quarter_of_the_bytes_and_serves(tiny_dir, monkeypatch):
    """A float32 model: each cached value takes 1 byte instead of 4, so the same budget
    holds 4x the blocks; the engine compiles and generates over the fp8 cache."""
    per_block = {}
    for kv_dtype in ("auto", "fp8"):
        args = EngineArgs(str(tiny_dir), dtype="float32", kv_cache_dtype=kv_dtype)
        config = args.create_engine_config()
        runner = ModelRunner(load_model(str(tiny_dir), dtype="float32"), config)
        per_block[kv_dtype] = runner.kv_bytes_per_block()
    assert per_block["auto"] == 4 * per_block["fp8"]
    with pytest.raises(ValueError, match="'fp4'"):
        EngineArgs(str(tiny_dir), kv_cache_dtype="fp4").create_engine_config()

    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, dtype="float32")
    params = SamplingParams(max_tokens=4, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": list(range(5, 30))}, {"prompt_token_ids": [7, 8, 9]}]
    logprobs = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(str(tiny_dir), kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=1 << 20, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        # the prompt's tokens scored over the cache (25 tokens: prefilled in two chunks)
        logprobs[kv_dtype] = np.array([
            lp[t].logprob for o in outs
            for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
        ])  # fmt: skip
        cache = llm.llm_engine.engine_core.engine_core.runner.kv_caches[0]
        assert cache.dtype == (jnp.float32 if kv_dtype == "auto" else jnp.float8_e4m3fn)
    err = np.abs(logprobs["fp8"] - logprobs["auto"])
    assert 0 < err.mean() < 0.05 and err.max() < 0.3, err
