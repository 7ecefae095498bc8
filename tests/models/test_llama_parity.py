"""Logits parity with HF transformers (fp32) on tiny random-weight models of each family.

Several sequences of different lengths are prefilled in one flat batch (one of them in two
chunks, the second starting mid-sequence next to another sequence's decode), then decoded step
by step, with the KV cache in shuffled, non-contiguous blocks. Every logit row is compared
with HF's full-sequence forward.
"""

import numpy as np
import pytest

from jaxserve.models.loader import load_model
from tests.helpers import PagedSequences, hf_logits, hf_model, make_tiny_hf

FAMILIES = {  # fmt: skip
    "llama-gqa-untied": ("llama", {}),
    "llama3-rope-tied": (
        "llama",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),  # fmt: skip
    "mistral": ("mistral", dict(sliding_window=None)),
    # prompts of 11 and 17 tokens and their decodes run past the 6-token window
    "mistral-sliding-window": ("mistral", dict(sliding_window=6)),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-yarn": (  # and attention_bias: q/k/v and o_proj biases
        "llama",
        dict(
            attention_bias=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8
            ),
        ),
    ),  # fmt: skip
    "phi3-fused": ("phi3", dict(pad_token_id=0)),  # HF's qkv_proj and gate_up_proj
    # sliding / full layers (a 6-token window), soft caps small enough to bite, scaled
    # embeddings, sandwich norms, GELU; Gemma 3: q/k norms, its own rotary for sliding layers
    "gemma2": (
        "gemma2",
        dict(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        "gemma3",
        dict(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    # Gemma 4: full layers of 2 KV heads of 32 beside 8 of 16 (V = K's projection: two of
    # them pack one cache slot), a proportional rotary, the last two layers reading earlier
    # layers' KV (their MLPs twice as wide), per-layer embeddings, experts beside each MLP
    "gemma4": (
        "gemma4",
        dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 3,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=256,
            final_logit_softcapping=3.0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=16,
        ),
    ),
    # q/k norms, and a head_dim that is not hidden_size / heads (8 x 16 = 128 != 64)
    "qwen3-qk-norm": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_model_dir(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    return make_tiny_hf(family, tmp_path_factory.mktemp(request.param), **overrides)


def run_mixed_schedule(loaded, prompts, decode_steps=4, seed=0):
    """Returns ({seq: all token ids fed}, {seq: logits [len, V] for those tokens})."""
    rng = np.random.default_rng(seed)
    paged = PagedSequences(loaded, seed=seed)
    fed = {i: [] for i in range(len(prompts))}
    got = {i: [] for i in range(len(prompts))}

    def run(chunks):
        for seq, logits in paged.step(chunks).items():
            fed[seq] += chunks[seq]
            got[seq].append(logits)

    # Step 1: seq 0's first chunk with the full prompts of the others.
    split = len(prompts[0]) // 2
    run({0: prompts[0][:split], **{i: p for i, p in enumerate(prompts) if i}})
    # Step 2: seq 0's second chunk (starts mid-block) beside single-token decodes.
    run({0: prompts[0][split:], **{i: [int(rng.integers(1, 200))] for i in fed if i}})
    for _ in range(decode_steps):
        run({i: [int(rng.integers(1, 200))] for i in fed})
    return fed, {i: np.concatenate(v) for i, v in got.items()}


def test_logits_match_hf(tiny_model_dir):
    loaded = load_model(tiny_model_dir, dtype="float32")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5, 17)]
    fed, logits = run_mixed_schedule(loaded, prompts)
    ref_model = hf_model(str(tiny_model_dir))
    for seq, tokens in fed.items():
        ref = hf_logits(ref_model, tokens)
        np.testing.assert_allclose(logits[seq], ref, atol=1e-4, rtol=0)


def test_bf16_with_the_norm_folded_is_as_close_to_hf(tmp_path, monkeypatch):
    """RMSNorm's 1 / rms applied to the rows of the next projection's output
    (DecoderLayer._normed: no norm pass of its own on a GPU) rounds at other points than HF's
    norm-first order: in bfloat16 its logits are as close to HF's float32 ones as those of
    the norm-first order, run by the same code with the fold turned off."""
    from jaxserve.models.llama import DecoderLayer

    model_dir = make_tiny_hf("llama", tmp_path)
    prompts = [np.random.default_rng(2).integers(1, 256, n).tolist() for n in (9, 4)]
    ref_model = hf_model(str(model_dir))

    def worst_error() -> float:
        fed, logits = run_mixed_schedule(load_model(model_dir, dtype="bfloat16"), prompts)
        return max(
            np.abs(logits[s].astype(np.float32) - hf_logits(ref_model, t)).max()
            for s, t in fed.items()
        )

    folded = worst_error()
    monkeypatch.setattr(DecoderLayer, "_normed", staticmethod(lambda norm, layer, x: (norm(x), {})))
    norm_first = worst_error()
    assert 0 < folded <= 1.5 * norm_first, (folded, norm_first)
