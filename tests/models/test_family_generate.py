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
