"""`load_format="dummy"`: random weights of a model's shapes from its config alone (a
directory, a config.json or a preset name), and an engine that runs on token ids without a
tokenizer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from jaxserve.benchmarks.roofline import param_counts
from jaxserve.distributed.sharding import kv_head_replicas
from jaxserve.entrypoints.llm import LLM
from jaxserve.models.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.transformers_utils.config import read_model_config
from jaxserve.transformers_utils.model_path import PRESETS_DIR, model_presets, resolve_model_path
from tests.helpers import TINY

TINY_CONFIG = {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "rms_norm_eps": 1e-5, "eos_token_id": 2}  # fmt: skip


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dummy")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


def _params(loaded) -> dict:
    return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(loaded.model)))


def test_model_is_a_directory_a_config_file_or_a_preset(config_dir):
    assert resolve_model_path(config_dir, "dummy") == config_dir
    assert resolve_model_path(config_dir / "config.json", "dummy") == config_dir
    assert {"llama-3-8b", "llama-3.2-1b"} <= set(model_presets())
    assert resolve_model_path("llama-3-8b", "dummy") == PRESETS_DIR / "llama-3-8b"
    with pytest.raises(FileNotFoundError, match="neither a path nor a preset .*llama-3-8b"):
        resolve_model_path("llama-9", "dummy")
    with pytest.raises(FileNotFoundError, match="a preset: use load_format='dummy'"):
        resolve_model_path("llama-3-8b")
    with pytest.raises(ValueError, match="load_format 'npcache' is not one of auto, dummy"):
        resolve_model_path(config_dir, "npcache")


def test_llama_3_8b_preset_has_the_real_shapes():
    c = read_model_config(resolve_model_path("llama-3-8b", "dummy"), "bfloat16")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        4096, 32, 32, 8, 128,
    )  # fmt: skip
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (14336, 128256, 8192)
    assert c.rope.theta == 500000.0 and not c.tie_word_embeddings and c.dtype == jnp.bfloat16
    total, matmul, _ = param_counts(c)  # abstract shapes only: nothing is allocated
    assert total == 8_030_261_248  # Meta-Llama-3-8B's published count
    assert matmul == total - 128256 * 4096 - (2 * 32 + 1) * 4096  # no lookup table, no norms


def test_dummy_weights_have_the_shapes_dtype_and_scale_asked_for(config_dir):
    loaded = load_model(config_dir, dtype="bfloat16", load_format="dummy")
    assert loaded.tokenizer is None
    params = _params(loaded)
    assert {p.dtype for p in params.values()} == {jnp.dtype(jnp.bfloat16)}
    qkv = params[("layers", 2, "self_attn", "qkv_proj", "kernel")]
    assert qkv.shape == (64, (8 + 2 * 2) * 8)  # [D, (Hq + 2 Hkv) * hd]
    assert np.all(np.asarray(params[("norm", "weight")], np.float32) == 1.0)
    w = np.asarray(params[("layers", 0, "mlp", "gate_up_proj", "kernel")], np.float32)
    assert 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.002
    w1 = np.asarray(params[("layers", 1, "mlp", "gate_up_proj", "kernel")], np.float32)
    assert not np.array_equal(w1.ravel()[:64], w.ravel()[:64])  # not one stream
    again = _params(load_model(config_dir, dtype="bfloat16", load_format="dummy"))
    np.testing.assert_array_equal(np.asarray(again[("embed_tokens", "embedding")]),
                                  np.asarray(params[("embed_tokens", "embedding")]))  # fmt: skip


def test_dummy_weights_are_placed_in_their_tp_sharding(config_dir, cpu_devices):
    from jaxserve.distributed.mesh import make_mesh

    loaded = load_model(config_dir, load_format="dummy", mesh=make_mesh(2, cpu_devices))
    up = _params(loaded)[("layers", 0, "mlp", "gate_up_proj", "kernel")]
    assert up.sharding.spec[1] == "tp" and len(up.addressable_shards) == 2


def test_engine_runs_token_ids_without_a_tokenizer(config_dir, monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(config_dir / "config.json"), load_format="dummy", max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=64)  # fmt: skip
    assert llm.get_tokenizer() is None
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert len(ids) == 6 and all(0 <= t < TINY["vocab_size"] for t in ids)
    assert out.outputs[0].text == ""  # nothing to detokenize with
    with pytest.raises(ValueError, match="this model has no tokenizer: pass"):
        llm.generate("hello", params)
    jax.clear_caches()


def test_gpt_oss_20b_preset_has_transformers_parameter_count():
    """The preset's shapes as transformers' own GptOssForCausalLM builds them (on the meta
    device: nothing allocated), the experts counted unquantized."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path("gpt-oss-20b", "dummy")
    c = read_model_config(path, "bfloat16")
    assert (c.num_layers, c.num_experts, c.num_experts_per_tok, c.sliding_window) == (
        24,
        32,
        4,
        128,
    )
    assert c.attention_sinks and c.o_proj_bias and c.moe_routing.swiglu_limit == 7.0
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert param_counts(c)[0] == sum(p.numel() for p in hf.parameters())


def test_llama_4_scout_preset_has_transformers_parameter_count():
    """Llama-4-Scout's text model: 48 layers, every one with 16 experts (top 1) and a shared
    one, every 4th without rotary; the parameter count transformers' Llama4ForCausalLM has."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path("llama-4-scout", "dummy")
    c = read_model_config(path, "bfloat16")
    assert (c.num_layers, c.num_experts, c.num_experts_per_tok) == (48, 16, 1)
    assert c.nope_layers == tuple(range(3, 48, 4)) and c.attention_chunk_size == 8192
    assert not c.dense_layers and c.qk_l2_norm and c.attn_temperature == (8192.0, 0.1)
    assert param_counts(c)[0] == 107_769_861_120  # transformers' count, as below per layer
    # transformers' own model of 4 of its layers (one without rotary; building all 48 on the
    # meta device takes seconds) has the parameters of ours
    four = read_model_config(path, "bfloat16", hf_overrides={"num_hidden_layers": 4})
    hf_config = AutoConfig.from_pretrained(path, num_hidden_layers=4)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    assert param_counts(four)[0] == sum(p.numel() for p in hf.parameters())


def test_qwen3_next_80b_preset_has_transformers_parameter_count():
    """Qwen3-Next-80B-A3B: 48 layers, every 4th full attention, 512 experts (top 10) and a
    gated shared expert in each; 79.7B parameters (its multi-token-prediction layer is not
    read), and 4 of its layers have the parameters transformers' own Qwen3NextForCausalLM
    gives them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path("qwen3-next-80b", "dummy")
    c = read_model_config(path, "bfloat16")
    assert (c.num_layers, c.num_experts, c.num_experts_per_tok) == (48, 512, 10)
    assert c.kv_layers == tuple(range(3, 48, 4)) and c.linear_attn.conv_dim == 8192
    assert param_counts(c)[0] == 79_674_391_296
    # 4 layers with 32 experts: every kind of weight, built in a second on the meta device
    small = {"num_hidden_layers": 4, "num_experts": 32}
    four = read_model_config(path, "bfloat16", hf_overrides=small)
    assert four.kv_layers == (3,) and four.linear_attn.layers == (0, 1, 2)
    hf_config = AutoConfig.from_pretrained(path, **small, layer_types=c.hf_config.layer_types[:4])
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    assert param_counts(four)[0] == sum(p.numel() for p in hf.parameters())


def test_glm_5_preset_has_transformers_parameter_count():
    """GLM-5: 78 MLA layers with the sparse-attention indexer, 256 experts (top 8) and a
    shared one after 3 dense layers: 744B parameters, and 4 of its layers (16 experts) have
    those transformers' own GlmMoeDsaForCausalLM gives them (its routing bias a buffer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path("glm-5", "dummy")
    c = read_model_config(path, "bfloat16")
    assert (c.num_layers, c.num_experts, c.num_experts_per_tok) == (78, 256, 8)
    assert (c.mla.index_n_heads, c.mla.index_head_dim, c.mla.index_topk) == (32, 128, 2048)
    # 744B: 4 layers (3 dense) and 74 more of the 5th's size (building all 78: 28 s)
    p4, p5 = (
        param_counts(read_model_config(path, "bfloat16", hf_overrides={"num_hidden_layers": n}))[0]
        for n in (4, 5)
    )
    assert round((p4 + 74 * (p5 - p4)) / 1e9) == 744
    small = {"num_hidden_layers": 4, "n_routed_experts": 16}
    four = read_model_config(path, "bfloat16", hf_overrides=small)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, **small))
    bias = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert param_counts(four)[0] == sum(p.numel() for p in hf.parameters()) + bias


@pytest.mark.parametrize(
    ("preset", "billions", "layers"),
    [
        ("gemma-4-31b", 30.8, 60),
        ("gemma-4-26b-a4b", 25.2, 30),
        ("gemma-4-e4b", 7.5, 42),
        ("qwen3.5-35b-a3b", 34.7, 40),
        ("qwen3.5-27b", 26.9, 64),
    ],
)
def test_2026_presets_have_transformers_parameter_count(preset, billions, layers):
    """Gemma 4 31B, 26B-A4B and E4B (text) and Qwen3.5-35B-A3B and 27B: 6 of their layers (16
    experts; E4B: 12, the last 2 reading earlier layers' KV) have the parameters transformers' own
    classes give them, but for the KV projections of Gemma 4's narrower layers, stored once
    per cache head they fill (models/gemma4.py: the 31B's full layers' 4 heads of 512
    twice, the E4B's sliding layers' 2 heads of 256 twice)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(preset, "dummy")
    c = read_model_config(path, "bfloat16")
    assert c.num_layers == layers and round(param_counts(c)[0] / 1e9, 1) == billions
    small = {"num_hidden_layers": 6} | ({"num_experts": 16} if c.num_experts else {})
    if c.gemma4 is not None and c.hf_config.num_kv_shared_layers:
        small |= {"num_hidden_layers": 12, "num_kv_shared_layers": 2}  # a full layer to share
    six = read_model_config(path, "bfloat16", hf_overrides=small)
    types = c.hf_config.layer_types[: small["num_hidden_layers"]]
    hf_config = AutoConfig.from_pretrained(path, **small, layer_types=types)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))
    repeated = 0
    if six.gemma4 is not None:  # each cached layer's K (and V) heads past their first copy
        cache = six.num_kv_heads * kv_head_replicas(six, 1) * six.head_dim
        for layer in six.kv_layers:
            heads, head_dim = six.layer_kv_shape(layer)
            projections = 1 if six.gemma4.k_eq_v and six.layer_window(layer) is None else 2
            repeated += (cache - heads * head_dim) * c.hidden_size * projections
    assert param_counts(six)[0] == sum(p.numel() for p in hf.parameters()) + scalars + repeated
