"""Through the whole engine (scheduler, chunked prefill, runner, sampler): greedy tokens of a
tiny Gemma 3 (interleaved sliding / full layers, a window shorter than the prompts) equal HF
`generate` over 32 steps, and logprobs agree within 1e-2, at tp 1 and 2 (host devices)."""

import numpy as np
import pytest
import torch

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import hf_model, make_tiny_hf


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_tiny_hf(
        "gemma3", tmp_path_factory.mktemp("gemma3"), head_dim=16, sliding_window=6,
        query_pre_attn_scalar=24, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_generate_matches_hf(gemma3_dir, monkeypatch, tp):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(gemma3_dir), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              dtype="float32", tensor_parallel_size=tp)  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 23, 14)]  # 23: chunked (16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = hf_model(str(gemma3_dir))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)  # fmt: skip
        want = gen.sequences[0, len(prompt) :].tolist()  # HF stops at EOS (we ignore it)
        assert len(want) >= 5 and out.outputs[0].token_ids[: len(want)] == want
        steps = zip(gen.logits, want, strict=True)
        hf_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in steps]
        ours = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want, strict=False)]
        np.testing.assert_allclose(ours, hf_lp, atol=1e-2)


def test_mistral_sliding_window_generate_matches_hf_and_gives_back_blocks(tmp_path, monkeypatch):
    """Every layer windowed (8 keys, blocks of 4): greedy tokens and logprobs equal HF
    generate's past the window, and no request holds more than the window's blocks plus the
    ones being written (the KV manager gives the rest back as it runs). 13 usable blocks for
    two requests of 37 and 53 tokens: given-back blocks are reused by the other request while
    the runner's block table still names them, outside the window."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = make_tiny_hf("mistral", tmp_path, head_dim=16, sliding_window=8)
    llm = LLM(str(model_dir), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              dtype="float32", block_size=4, num_gpu_blocks_override=14)  # fmt: skip
    engine = llm.llm_engine
    kv = engine.engine_core.engine_core.scheduler.kv_cache_manager
    assert kv.sliding_window == 8
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 21)]  # 21: chunked (16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    finished, most_held = {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        for blocks in kv.req_to_blocks.values():
            most_held = max(most_held, sum(not b.is_null for b in blocks))
    assert most_held <= 8 // 4 + 16 // 4 + 1  # window + a 16-token chunk (+ a partial block)
    assert engine.engine_core.engine_core.scheduler.total_preemptions == 0
    kv.check_no_leaks()
    ref = hf_model(str(model_dir))
    for i, prompt in enumerate(prompts):
        out = finished[str(i)].outputs[0]
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)  # fmt: skip
        want = gen.sequences[0, len(prompt) :].tolist()
        assert len(want) >= 5 and out.token_ids[: len(want)] == want
        steps = zip(gen.logits, want, strict=True)
        hf_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in steps]
        ours = [lp[t].logprob for lp, t in zip(out.logprobs, want, strict=False)]
        np.testing.assert_allclose(ours, hf_lp, atol=1e-2)
