"""Embeddings (runner="pooling"): LLM.embed gives the HF model's pooled final hidden states
(last token or mean, normalised), for prompts of mixed lengths prefilled in chunks, and leaks
no KV block."""

import json

import numpy as np
import pytest
import torch

from jaxserve.entrypoints.llm import LLM
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from tests.helpers import core_of, make_tiny_hf

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, dtype="float32")
PROMPTS = [list(range(3, 8)), list(range(20, 43)), [9], list(range(100, 131))]  # 23, 31: chunked


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("qwen3", tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def hf_states(model_dir):
    """The HF model's final (normed) hidden states of each prompt: [len, D] each."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in PROMPTS]


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embeddings_are_hfs_pooled_hidden_states(model_dir, hf_states, monkeypatch, pooling_type):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(model_dir), runner="pooling", pooler_config={"pooling_type": pooling_type},
              **ENGINE)  # fmt: skip
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, prompt, states in zip(outs, PROMPTS, hf_states, strict=True):
        want = states[-1] if pooling_type == "LAST" else states.mean(axis=0)
        got = np.asarray(out.outputs.embedding)
        assert out.prompt_token_ids == prompt and got.shape == want.shape
        assert _cosine(got, want) > 0.999
        np.testing.assert_allclose(np.linalg.norm(got), 1.0, rtol=1e-5)  # normalised
    raw = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=False))
    want = hf_states[1][-1] if pooling_type == "LAST" else hf_states[1].mean(axis=0)
    np.testing.assert_allclose(raw[0].outputs.embedding, want, rtol=1e-3, atol=1e-4)
    short = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=16))
    assert len(short[0].outputs.embedding) == 16
    core = core_of(llm)
    assert not core.scheduler.kv_cache_manager.enable_caching  # MEAN needs every token
    core.scheduler.kv_cache_manager.check_no_leaks()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.runner.num_blocks - 1
    with pytest.raises(ValueError, match="use LLM.embed"):
        llm.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="dimensions=65 must be between 1 and the model's 64"):
        llm.embed({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=65))


def test_pooling_configuration(model_dir, tmp_path):
    from jaxserve.engine.arg_utils import EngineArgs

    def pooler(**kw):
        return EngineArgs(str(model_dir), **kw).create_engine_config().pooler

    assert pooler() is None and pooler(runner="generate") is None
    assert pooler(task="embed").pooling_type == "LAST" and pooler(task="embed").normalize
    assert pooler(runner="pooling", pooler_config='{"pooling_type": "mean"}').pooling_type == "MEAN"
    with pytest.raises(ValueError, match="pooling_type 'MAX'"):
        pooler(runner="pooling", pooler_config={"pooling_type": "max"})
    with pytest.raises(ValueError, match="runner 'embedder'"):
        pooler(runner="embedder")
    # a sentence-transformers dir: its Pooling module's mode, and a Normalize module or not
    st = tmp_path / "st"
    st.mkdir()
    for f in model_dir.iterdir():
        (st / f.name).write_bytes(f.read_bytes())
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    config = EngineArgs(str(st), runner="pooling").create_engine_config().pooler
    assert (config.pooling_type, config.normalize) == ("MEAN", False)
