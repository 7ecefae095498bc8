"""MiniMax-M2: q / k norms over each whole projection, partial rotary, sigmoid routing with a
score correction bias over 8 experts (top 2). Logits equal HF's at tp 1 and 4 (tp 4: each KV
head twice, the k norm's heads with it; the norms' means summed over the split heads);
greedy tokens and logprobs through the engine at tp 2 equal HF generate's."""

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.models.loader import load_model
from tests.helpers import assert_generate_matches_hf, hf_logits, hf_model, make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule

SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
             num_experts_per_tok=2, intermediate_size=32, bos_token_id=None, eos_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5})  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("minimax_m2", tmp_path_factory.mktemp("minimax_m2"), **SHAPE)


@pytest.mark.parametrize("tp", [1, 4])
def test_logits_match_hf(model_dir, tp):
    loaded = load_model(str(model_dir), dtype="float32", tensor_parallel_size=tp)
    c = loaded.config
    assert c.qk_norm_over_heads and not c.qk_norm and c.rotary_dim == 8
    assert c.moe_routing.scoring == "sigmoid" and c.num_experts == 8
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (11, 5, 17)]
    fed, logits = run_mixed_schedule(loaded, prompts)
    ref = hf_model(str(model_dir))
    for seq, tokens in fed.items():
        np.testing.assert_allclose(logits[seq], hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_generate_matches_hf(model_dir, monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(model_dir), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
              dtype="float32", tensor_parallel_size=2)  # fmt: skip
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 19, 40)]
    assert_generate_matches_hf(llm, model_dir, prompts, max_tokens=12)
