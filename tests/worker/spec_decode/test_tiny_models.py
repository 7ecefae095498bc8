"""Speculative decoding on tiny random models: the sampled distribution is the target's, and a
draft model's greedy output equals the target's alone. (Kept apart from the default-model
tests: a tiny engine compiled while those engines were alive in the same module crashed XLA in
CI twice; see compile_all.)"""

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_hf
from tests.worker.spec_decode.test_spec_decode import AcceptCounter, core, token_ids


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random llama with a 16-token vocabulary, its logits sharpened (one token takes about
    half the mass): drafts are right often enough to test both outcomes."""
    import torch
    import transformers

    path = make_tiny_hf("llama", tmp_path_factory.mktemp("tiny16"), vocab_size=16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    model.save_pretrained(path)
    return path


def token_counts(llm, prompt, params, n, position):
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    counts = np.zeros((len(position), 16), np.int64)
    for o in outs:
        for row, pos in enumerate(position):
            counts[row, o.outputs[0].token_ids[pos]] += 1
    return counts


def test_sampled_tokens_keep_the_target_distribution(tiny_dir):
    """Unseeded sampling (temperature, top-k) with and without ngram drafts: per output
    position, the token frequencies over 2000 samples agree (chi-square, p > 0.001). Every
    token occurs in the prompt and every step has room for drafts (the CPU's draft-room rule
    and the backoff are off), so nearly every decode is drafted; a fair share of the drafts are
    accepted, so both branches of the rejection rule are exercised. (Keeping the sample of the
    row after a rejected draft instead gives p < 1e-11 at positions 1 and 2 over 3000.)"""
    prompt = [*range(1, 16), *range(15, 0, -1), 3, 7, 1, 9]
    params = SamplingParams(temperature=0.8, top_k=10, max_tokens=4, ignore_eos=True)
    engine = dict(model=str(tiny_dir), max_num_seqs=16, max_num_batched_tokens=64,
                  max_model_len=128, seed=0, max_logprobs=5)  # fmt: skip
    plain = LLM(**engine)
    spec = LLM(
        **engine,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
    )
    core(spec).scheduler.draft_step_tokens = None  # drafts fill the token budget
    core(spec).runner.drafting.backoff.should_draft = lambda req_id: True
    counter = AcceptCounter(spec)
    positions = [1, 2, 3]  # token 0 comes from the prompt's last position: never drafted
    with_spec = token_counts(spec, prompt, params, 2000, positions)
    assert counter.drafted > 2000 and 0.05 < counter.accepted / counter.drafted < 0.9, vars(counter)
    without = token_counts(plain, prompt, params, 2000, positions)
    for row in range(len(positions)):
        table = np.stack([with_spec[row], without[row]])
        table = table[:, table.sum(axis=0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, (positions[row], table)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random llama target and a smaller random draft of its vocabulary."""
    root = tmp_path_factory.mktemp("pair")
    target = make_tiny_hf("llama", root / "target")
    draft = make_tiny_hf("llama", root / "draft", num_hidden_layers=1, hidden_size=32,
                         intermediate_size=64, num_attention_heads=4)  # fmt: skip
    return target, draft


def test_draft_model_greedy_equals_decoding_without_speculation(tiny_pair):
    """Greedy output with a draft model equals the target's alone, through chunked prefill
    (16-token budget), prefix-cache hits (each prompt twice) and up to max_model_len. With
    the target as its own draft every draft is accepted: the draft's KV cache (mirrored
    steps, lookahead slots, cached blocks) holds what the target's does."""
    target, draft = tiny_pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 23, 40, 70)]
    prompts = [{"prompt_token_ids": p} for p in prompts + prompts]
    params = [  # the longest prompt runs up to max_model_len
        SamplingParams(temperature=0.0, max_tokens=min(32, 96 - len(p["prompt_token_ids"])),
                       ignore_eos=True)
        for p in prompts
    ]  # fmt: skip
    engine = dict(model=str(target), max_num_seqs=4, max_num_batched_tokens=16,
                  max_model_len=96, max_logprobs=5)  # fmt: skip
    engines = [LLM(**engine)]  # all kept until the test ends
    want = token_ids(engines[0].generate(prompts, params, use_tqdm=False))
    for path in (draft, target):
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
        llm = LLM(**engine, speculative_config=spec)
        engines.append(llm)
        counter = AcceptCounter(llm)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert counter.drafted > 30  # a draft that is never right backs off (DraftBackoff)
        if path == target:
            assert counter.accepted == counter.drafted, vars(counter)
        core(llm).scheduler.kv_cache_manager.check_no_leaks()


def test_penalised_greedy_drafts_count_the_drafts_before_them(tiny_dir):
    """Greedy with strong penalties, one request at a time so every step has room for drafts:
    a draft row must count the drafts before it as output (and the row's penalty state the
    accepted ones), or its argmax differs from decoding without speculation."""
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(1, 16, 12).tolist()} for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            frequency_penalty=0.6, presence_penalty=0.2)  # fmt: skip
    engine = dict(model=str(tiny_dir), max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=128, max_logprobs=5)  # fmt: skip
    want = token_ids(LLM(**engine).generate(prompts, params, use_tqdm=False))
    spec = LLM(
        **engine,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
    )
    core(spec).runner.drafting.backoff.should_draft = lambda req_id: True  # every chance
    counter = AcceptCounter(spec)
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == want
    assert counter.accepted > 10, vars(counter)
