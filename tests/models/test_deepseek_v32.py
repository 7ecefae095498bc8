"""DeepSeek-V3.2 and GLM-5: DeepSeek-V3's MLA and experts with DeepSeek Sparse Attention (a
lightning indexer; each query attends to its index_topk best-scored context tokens; GLM-5's
indexer rotates interleaved pairs, and its "shared" layers reuse the last full layer's
top-k). A tiny model of each with index_topk 8: contexts below it (dense MLA) and above it
(the sparse path) give transformers' logits over a mixed schedule at tp 1 and 2, and the
engine's greedy tokens and logprobs transformers' generate's through chunked prefill and
preemption."""

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.models.loader import load_model
from tests.helpers import assert_generate_matches_hf, core_of, hf_logits, hf_model, make_tiny_hf
from tests.models.test_fp8_moe import assert_logits_match, fp8_block_checkpoint
from tests.models.test_llama_parity import run_mixed_schedule
from tests.models.test_moe import FAMILIES

TOPK = 8
SHAPE = {**FAMILIES["deepseek_v3"], "index_n_heads": 8, "index_head_dim": 16, "index_topk": TOPK}
# GLM-5's third layer reuses the second's top-k (the last full layer's, not the first's)
GLM_5 = {**SHAPE, "indexer_types": ["full", "full", "shared"]}
FAMILY_SHAPES = {"deepseek_v32": SHAPE, "glm_moe_dsa": GLM_5}


@pytest.fixture(scope="module", params=sorted(FAMILY_SHAPES))
def model_dir(request, tmp_path_factory):
    """The tiny model, its indexer's head weights made positive: a random one scores many
    context tokens exactly 0 (every head's relu 0, weighed by mixed signs), and where such
    ties straddle the top-k boundary which tokens are kept is each top-k's own order
    (torch.topk's against XLA's), not the model's."""
    from safetensors.torch import load_file, save_file

    family = request.param
    path = make_tiny_hf(family, tmp_path_factory.mktemp(family), **FAMILY_SHAPES[family])
    weights = load_file(str(path / "model.safetensors"))
    for name in [n for n in weights if n.endswith("indexer.weights_proj.weight")]:
        weights[name] = weights[name].abs()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_hf_below_and_above_index_topk(model_dir, tp):
    loaded = load_model(str(model_dir), dtype="float32", tensor_parallel_size=tp)
    m = loaded.config.mla
    assert (m.index_n_heads, m.index_head_dim, m.index_topk) == (8, 16, TOPK)
    assert loaded.config.cache_dims == (m.latent_dim, 16)  # the index keys: V's columns
    assert m.index_shared == ((False, False, True) if "glm" in str(model_dir) else ())
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 23, 17)]  # 5: never past top-k
    fed, logits = run_mixed_schedule(loaded, prompts)
    ref = hf_model(str(model_dir))
    assert max(len(tokens) for tokens in fed.values()) > 2 * TOPK
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_generate_matches_hf(model_dir, monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(model_dir), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=6)  # fmt: skip
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 19, 40)]
    assert_generate_matches_hf(llm, model_dir, prompts, max_tokens=12)
    assert core_of(llm).scheduler.total_preemptions > 0


def test_shared_indexer_layers_keep_no_index_keys_and_offload(model_dir, monkeypatch):
    """GLM-5's shared-indexer layer keeps no index keys: the V cache holds the two full
    layers' slots of three (K all three), the bytes per block shrink by one layer's index
    keys; its blocks go to the host tier and come back (the shared layer's V travels as
    zeros) with the same tokens. DeepSeek-V3.2: every layer its own V slot."""
    from tests.helpers import assert_offload_round_trip, runner_of

    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(model_dir), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=160,
              dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=14,
              kv_offloading_size=0.01)  # fmt: skip
    kv = runner_of(llm).kv
    glm = "glm" in str(model_dir)
    assert (kv.num_slots, kv.num_v_slots) == ((3, 2) if glm else (3, 3))
    assert kv.v_slots == ((0, 1, None) if glm else None)
    k_dim, v_dim = runner_of(llm).config.cache_dims
    assert kv.bytes_per_block() == kv.block_size * (3 * k_dim + kv.num_v_slots * v_dim) * 4
    # (GLM-5's 100-token prompt ties three tokens' index scores, exactly 0, at the top-k
    # boundary of its 104th position, where torch's top-k and XLA's keep different ones:
    # its round trip is checked against its own first run)
    assert_offload_round_trip(llm, model_dir, against_hf=not glm)


# As the published FP8 builds (DeepSeek-V3.2, GLM-5-FP8): every decoder projection and the
# indexer's wq_b and wk fp8 with block scales; the indexer's weights_proj and norms not
FP8_LINEAR = ("a_proj.weight", "b_proj.weight", "o_proj.weight", "gate_proj.weight",
              "up_proj.weight", "down_proj.weight", "proj_with_mqa.weight", "wq_b.weight",
              "wk.weight")  # fmt: skip


def test_fp8_block_checkpoint_matches_transformers(model_dir, tmp_path):
    """The indexer's fp8 projections load packed (wk's 16 rows a partial 32-row block), and
    the logits past index_topk are transformers' of the weights its fp8 dequantization
    decodes."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    fp8 = tmp_path / "fp8"
    shutil.copytree(model_dir, fp8)
    stored, decoded = fp8_block_checkpoint(fp8, FP8_LINEAR)
    assert "model.layers.0.self_attn.indexer.wk.weight_scale_inv" in stored
    assert "model.layers.0.self_attn.indexer.weights_proj.weight_scale_inv" not in stored
    loaded = load_model(str(fp8), dtype="float32")
    indexer = loaded.model.layers[0].self_attn.indexer
    assert str(indexer.wq_b.kernel[...].dtype) == "float8_e4m3fn"
    assert indexer.wk.kernel[...].shape == (64, 16) and indexer.wk.scale[...].shape == (2, 16)
    ref = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32).eval()
    rng = np.random.default_rng(5)
    assert_logits_match(loaded, ref, [rng.integers(1, 256, n).tolist() for n in (21, 6)])
