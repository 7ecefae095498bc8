"""A request the whole KV pool cannot hold at its longest (a pool made small with
num_gpu_blocks_override) finishes at once with an error naming the blocks it needs (it would
otherwise preempt itself forever); the requests beside it are served."""

import numpy as np

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import core_of, make_tiny_hf


def test_a_request_larger_than_the_pool_fails_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = make_tiny_hf("llama", tmp_path)
    llm = LLM(str(model_dir), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
              dtype="float32", num_gpu_blocks_override=5)  # fmt: skip
    rng = np.random.default_rng(0)
    big, small = (rng.integers(1, 256, n).tolist() for n in (60, 10))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 20)]
    prompts = [{"prompt_token_ids": p} for p in (big, small)]
    too_big, fits = llm.generate(prompts, params, use_tqdm=False)
    assert too_big.outputs[0].finish_reason == "error"
    assert "needs up to 5 KV blocks of 16 tokens (80 tokens), more than the KV cache's 4" in str(
        too_big.outputs[0].stop_reason
    )
    assert fits.outputs[0].finish_reason == "length" and len(fits.outputs[0].token_ids) == 20
    core_of(llm).scheduler.kv_cache_manager.check_no_leaks()
