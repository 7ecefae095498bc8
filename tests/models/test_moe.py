"""Mixture of experts (Mixtral, Qwen3-MoE, GLM-4.5, DeepSeek-V3, gpt-oss, Llama 4): routing as
HF routes, logits as HF computes them, the same output with the experts split over devices (expert
parallel) or their F split (tensor parallel), and greedy generate through the whole engine
equal to HF's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.entrypoints.llm import LLM
from jaxserve.layers.fused_moe import configure_moe, expert_mlp
from jaxserve.models.loader import load_model
from tests.helpers import (
    TINY,
    assert_generate_matches_hf,
    assert_offload_round_trip,
    hf_logits,
    hf_model,
    make_tiny_hf,
    runner_of,
)
from tests.models.test_llama_parity import run_mixed_schedule

FAMILIES = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    # layer 1 dense, norm_topk_prob off: both code paths of the family
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                      mlp_only_layers=[1], norm_topk_prob=False, head_dim=16),
    # GLM-4.5's shape scaled down: layer 0 dense, sigmoid routing with a score bias among 4
    # groups of 4 experts (the best 2 groups compete), scaled, a shared expert; partial rotary
    # (half of each 16-wide head), q/k/v biases, q/k norms
    "glm4_moe": dict(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=32,
                     n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                     head_dim=16),
    # DeepSeek-V3's shape scaled down: MLA (q and kv low-rank, 16 + 8 query/key dims, the
    # rotary 8 interleaved, values of 16, a 32-wide latent; YaRN with mscale_all_dim, which
    # scales the scores by mscale ** 2) with GLM's experts in 2 groups
    "deepseek_v3": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                         "original_max_position_embeddings": 64,
                                         "mscale": 1.0, "mscale_all_dim": 1.0}),
    # DeepSeek-V2's: V3's MLA (no q_lora_rank: V2-Lite's plain q_proj), softmax routing
    # limited to the best 2 of 4 groups by their best score, scaled, not renormalised
    "deepseek_v2": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                        topk_method="group_limited_greedy", first_k_dense_replace=1,
                        routed_scaling_factor=2.5),
    # gpt-oss's shape scaled down: q/k/v/o biases, attention sinks, 6-token windows on
    # alternate layers, YaRN without truncation; 8 experts, top 4, router and expert biases,
    # a clamped SwiGLU whose limit bites
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=4, head_dim=16, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    swiglu_limit=0.3,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 64}),
    # Llama 4's text model scaled down: layers 0 and 2 rotary (interleaved pairs) with
    # 8-token attention chunks and weightless q/k norms, layer 1 without rotary, global, its
    # queries temperature-tuned (floor_scale 4 bites within the prompts); experts (top-1,
    # sigmoid-weighted inputs, a shared expert) on layers 0 and 1, a dense MLP on layer 2
    "llama4": dict(num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 1],
                   intermediate_size=32, intermediate_size_mlp=64, head_dim=16,
                   no_rope_layers=[1, 0, 1], attention_chunk_size=8, floor_scale=4,
                   attn_scale=0.1, use_qk_norm=True, attn_temperature_tuning=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
}  # fmt: skip


_rng = np.random.default_rng(1)
PROMPTS = [_rng.integers(1, 256, n).tolist() for n in (11, 5, 17)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """family -> (its tiny model's directory, the model loaded on one device, and
    run_mixed_schedule's (fed tokens, logits) over PROMPTS): each built once for the module,
    the reference of both the HF comparison and the parallel ones."""

    @functools.cache
    def build(family):
        path = make_tiny_hf(family, tmp_path_factory.mktemp(family), **FAMILIES[family])
        loaded = load_model(path, dtype="float32")
        return path, loaded, *run_mixed_schedule(loaded, PROMPTS)

    return build


@pytest.mark.parametrize("family", list(FAMILIES))
def test_routing_and_logits_match_hf(one_device, family):
    moe_dir, loaded, fed, logits = one_device(family)
    ref = hf_model(str(moe_dir))
    layer = min(i for i in range(loaded.config.num_layers) if loaded.config.is_moe_layer(i))
    hidden = torch.randn(11, ref.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hf_layer = ref.model.layers[layer]
    hf_moe = getattr(hf_layer, "mlp", None) or hf_layer.feed_forward  # Llama 4's name
    k = loaded.config.num_experts_per_tok
    with torch.no_grad():  # gpt-oss's and Llama 4's router is `router`, the others' `gate`
        routed = (getattr(hf_moe, "router", None) or hf_moe.gate)(hidden)
    if len(routed) == 2:  # Llama 4: (scores [T, E], zero off the picked experts; logits)
        hf_ids = routed[0].topk(k, dim=-1).indices
        hf_weights = routed[0].gather(-1, hf_ids)
    else:
        _, hf_weights, hf_ids = routed
    moe = loaded.model.layers[layer].mlp
    x = jnp.asarray(hidden.numpy())
    # jitted, as the runner runs them (eager, each op compiles on its own: 1.3 s a family)
    ids, weights = jax.jit(moe.route)(x)
    # the same experts at the same weights (GLM's router lists them in no set order)
    order, hf_order = np.argsort(np.asarray(ids), -1), np.argsort(hf_ids.numpy(), -1)
    sort = lambda a, o: np.take_along_axis(np.asarray(a), o, -1)  # noqa: E731
    np.testing.assert_array_equal(sort(ids, order), sort(hf_ids.numpy(), hf_order))
    np.testing.assert_allclose(sort(weights, order), sort(hf_weights.numpy(), hf_order),
                               atol=1e-6)  # fmt: skip
    with torch.no_grad():
        hf_out = hf_moe(hidden[None])
    hf_out = hf_out[0] if isinstance(hf_out, tuple) else hf_out  # gpt-oss, Llama 4: a pair
    hf_out = hf_out.reshape(hidden.shape).numpy()
    np.testing.assert_allclose(np.asarray(jax.jit(moe.__call__)(x)), hf_out, atol=1e-5)

    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_expert_mlp_skips_rows_of_other_devices_experts():
    """Experts 2-3 of 4 on this 'device': only rows routed to them count, each at its weight."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
    ids = jnp.array([[0, 3], [2, 1], [3, 2], [1, 0], [2, 3]], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(5, 2)), jnp.float32)
    w13 = jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(4, 3, 8)), jnp.float32)
    mlp = jax.jit(expert_mlp, static_argnames="first_expert")  # one compile, not one per op
    got = mlp(x, ids, weights, w13[2:], w2[2:], first_expert=2)
    x, ids, weights, w13, w2 = (np.asarray(a) for a in (x, ids, weights, w13, w2))  # the oracle
    want = np.zeros((5, 8), np.float32)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            if e >= 2:
                gu = (x[t] @ w13[e]).reshape(-1, 2)
                silu = gu[:, 0] / (1 + np.exp(-gu[:, 0]))
                want[t] += weights[t, j] * ((silu * gu[:, 1]) @ w2[e])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_expert_mlp_is_the_same_for_many_rows_as_for_few():
    """Group sizes are counted by comparisons for few rows and by jnp.bincount for many: a
    batch of 12,000 tokens (the latter) equals its 100-token slices (the former) row by row."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(12_000, 8)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 4, size=(12_000, 2)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(12_000, 2)), jnp.float32)
    w13 = jnp.asarray(rng.normal(size=(2, 8, 6)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    mlp = jax.jit(expert_mlp, static_argnames="first_expert")
    whole = mlp(x, ids, weights, w13, w2, first_expert=1)
    for start in (0, 5_000, 11_900):
        part = slice(start, start + 100)
        got = mlp(x[part], ids[part], weights[part], w13, w2, first_expert=1)
        np.testing.assert_allclose(np.asarray(whole[part]), np.asarray(got), atol=1e-5)


# Experts split by F (tensor parallel) on gpt-oss (expert biases, the clamped SwiGLU; sinks
# split with the query heads) and Llama 4 (chunked and global attention split by heads, a
# shared expert split as a dense MLP); experts split whole (expert parallel) on gpt-oss and
# on Qwen3-MoE over 4 devices (its dense layer among the sparse ones split by F beside them).
@pytest.mark.parametrize(
    ("family", "tp", "ep"),
    [("qwen3_moe", 4, True), ("gpt_oss", 2, False), ("gpt_oss", 2, True), ("llama4", 2, False)],
)
def test_expert_and_tensor_parallel_equal_one_device(one_device, family, tp, ep):
    path, _, _, want = one_device(family)
    split = load_model(path, dtype="float32", tensor_parallel_size=tp,
                       enable_expert_parallel=ep)  # fmt: skip
    configure_moe(split.model, split.mesh)  # as the runner does: per device, under shard_map
    w13 = split.model.layers[0].mlp.w13[...]
    local = w13.addressable_shards[0].data.shape
    assert local == ((8 // tp, *w13.shape[1:]) if ep else (*w13.shape[:2], w13.shape[2] // tp))
    _, got = run_mixed_schedule(split, PROMPTS)
    for seq in want:
        np.testing.assert_allclose(got[seq], want[seq], atol=1e-5)


def test_expert_parallel_needs_experts_that_split_evenly(one_device):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide .*num_experts=8"):
        load_model(one_device("qwen3_moe")[0], tensor_parallel_size=3, enable_expert_parallel=True)


def test_expert_parallel_needs_a_mixture_of_experts(tmp_path):
    dense = make_tiny_hf("llama", tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no experts"):
        load_model(dense, enable_expert_parallel=True)


def test_expert_parallel_generate_matches_hf(tmp_path, monkeypatch):
    """Mixtral through the whole engine (chunked prefill, batched decode) with its experts
    split over two devices: HF generate's tokens over 32 steps, logprobs within 1e-2."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = make_tiny_hf("mixtral", tmp_path, **FAMILIES["mixtral"])
    llm = LLM(str(model_dir), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)  # fmt: skip
    moe = runner_of(llm).model.layers[0].mlp
    assert moe.mesh is not None and moe.mesh.shape["tp"] == 2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 23, 14)]  # 23: chunked (16)
    assert_generate_matches_hf(llm, model_dir, prompts)


def test_mla_cache_is_one_latent_head_and_offloads(tmp_path, monkeypatch):
    """DeepSeek's cache holds kv_lora_rank + qk_rope_head_dim values a token a layer in one
    head (V empty), replicated per tensor-parallel rank; its blocks offload to the host tier
    (kv_offloading_size) and come back after device eviction: a prefix hit with HF's tokens."""
    from jaxserve.engine.arg_utils import EngineArgs

    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = make_tiny_hf("deepseek_v3", tmp_path, **FAMILIES["deepseek_v3"])
    config = EngineArgs(model=str(model_dir), tensor_parallel_size=2).create_engine_config()
    assert (config.model.num_kv_heads, config.model.cache_dims) == (1, (32 + 8, 0))
    llm = LLM(str(model_dir), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=160,
              dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=14,
              kv_offloading_size=0.01)  # fmt: skip
    assert_offload_round_trip(llm, model_dir)


@pytest.mark.parametrize(
    ("field", "value"), [("topk_method", "group_limited_greedy"), ("scoring_func", "softmax"),
                         ("moe_layer_freq", 2)],
)  # fmt: skip
def test_routing_fields_deepseek_does_not_honour_are_named(tmp_path, field, value):
    """A DeepSeek config that asks for another router (V2's), or experts on every other
    layer, is refused, naming the field: never served as V3's routing."""
    import json

    model_dir = make_tiny_hf("deepseek_v3", tmp_path, **FAMILIES["deepseek_v3"])
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=f"{field} {value!r} is not supported"):
        load_model(model_dir, dtype="float32")


@pytest.mark.parametrize(
    ("field", "message"),
    [({"attention_bias": True}, "attention_bias=True is not supported for Llama 4"),
     ({"layer_types": ["chunked_attention", "sliding_attention", "full_attention"]},
      r"layer_types\[1\] 'sliding_attention' is not supported for Llama 4"),
     ({"no_rope_layers": [1, 1, 0], "layer_types": ["chunked_attention"] * 3},
      "layer 2: chunked attention without rotary is not supported")],
)  # fmt: skip
def test_llama4_config_fields_it_cannot_honour_are_refused(field, message):
    from transformers import Llama4TextConfig

    from jaxserve.config import ModelConfig

    config = Llama4TextConfig(**{**TINY, **FAMILIES["llama4"], **field})
    config.architectures = ["Llama4ForCausalLM"]
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config, "float32")


def test_llama4_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (Scout's and Maverick's layout: the text
    model under `language_model.`, a vision tower beside it) loads as its text model: the
    logits of text prompts equal transformers' multimodal model's."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=32)  # fmt: skip
    config = Llama4Config(text_config={**TINY, **FAMILIES["llama4"]}, vision_config=vision)
    config.architectures = ["Llama4ForConditionalGeneration"]
    torch.manual_seed(0)
    ref = Llama4ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    ref.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.architecture == "Llama4ForConditionalGeneration"
    assert loaded.config.attention_chunk_size == 8 and loaded.config.nope_layers == (1,)
    fed, logits = run_mixed_schedule(loaded, PROMPTS)
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_mla_expanded_form_attends_within_fresh_sequences():
    """The expanded form (a prompt's first chunk): each fresh sequence's rows attend causally
    to its own tokens (a dense oracle); rows of other sequences keep the absorbed output."""
    from jaxserve.layers.attention import AttentionMetadata
    from jaxserve.models.deepseek import EXPANDED_TILE, expanded_attention

    rng = np.random.default_rng(0)
    t, h = EXPANDED_TILE + 40, 2  # sequences of 70, 1 and 90 tokens, padding: two tiles
    q, k = (rng.standard_normal((t, h, 24)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((t, h, 8)).astype(np.float32)
    absorbed = rng.standard_normal((t, h, 8)).astype(np.float32)
    qsl = np.array([0, 70, 71, 161, 161], np.int32)
    md = AttentionMetadata(
        np.zeros(t, np.int32),
        np.zeros((4, 1), np.int32),
        np.array([70, 30, 90, 0], np.int32),
        qsl,
        np.array([3], np.int32),
    )
    fresh = jnp.array([True, False, True, False])  # seq 1 continues a context
    args = (jnp.asarray(x) for x in (q, k, v, absorbed))
    out = np.asarray(expanded_attention(*args, fresh, md, 0.2))
    for s, (a, b) in enumerate(zip(qsl[:3], qsl[1:4], strict=True)):
        if s == 1:
            np.testing.assert_array_equal(out[a:b], absorbed[a:b])
            continue
        scores = np.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * 0.2
        scores = np.where(np.tril(np.ones((b - a, b - a), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v[a:b])
        np.testing.assert_allclose(out[a:b], want, atol=1e-5)
    np.testing.assert_array_equal(out[161:], absorbed[161:])  # padding rows
