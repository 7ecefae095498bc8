"""Speculative decoding end to end: exact greedy and seeded output on the default model, the
target distribution on a tiny one, no compilation after warm-up, no leaked blocks."""

import functools

import numpy as np
import pytest
from scipy.stats import chi2_contingency

import jaxserve.engine.core as core_module
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.worker.model_runner import num_compilations
from tests.helpers import make_tiny_hf

TEXT = (
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun while the "
    "quick brown fox runs around the farm. Farmers say the quick brown fox is the fastest "
    "animal on the farm, and they tell the story to every child in the village."
)
CHATS = [
    [{"role": "user", "content": f"Rewrite this text, replacing 'fox' with 'cat': {TEXT}"}],
    [{"role": "user", "content": f"Repeat this text word for word: {TEXT}"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],  # little to look up
    [{"role": "user", "content": "List three colours."}],
]
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def share_loaded_model():
    original = core_module.load_model
    core_module.load_model = functools.cache(original)
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    yield
    mp.undo()
    core_module.load_model = original


def core(llm):
    return llm.llm_engine.engine_core.engine_core


class AcceptCounter:
    """Sums the scheduler's speculative-decoding stats over every step (each snapshot
    resets them)."""

    def __init__(self, llm):
        self.drafted = self.accepted = 0
        sched = core(llm).scheduler
        take = sched._take_spec_stats

        def counting():
            stats = take()
            self.drafted += stats.num_draft_tokens
            self.accepted += stats.num_accepted_tokens
            return stats

        sched._take_spec_stats = counting


@pytest.fixture(scope="module")
def plain():
    return LLM(**SMALL)


@pytest.fixture(scope="module")
def ngram():
    return LLM(**SMALL, speculative_config=NGRAM)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_greedy_and_seeded_outputs_equal_decoding_without_speculation(plain, ngram):
    counter = AcceptCounter(ngram)
    for params in [
        SamplingParams(temperature=0.0, max_tokens=80),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=80, seed=7),
        SamplingParams(temperature=0.0, max_tokens=80, stop=["farm"], min_tokens=3),
    ]:
        want = plain.chat(CHATS, params, use_tqdm=False)
        got = ngram.chat(CHATS, params, use_tqdm=False)
        assert token_ids(got) == token_ids(want)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in want
        ]
    # The rewrite and the repetition are mostly drafts, accepted.
    assert counter.accepted > 100 and counter.accepted / counter.drafted > 0.4
    core(ngram).scheduler.kv_cache_manager.check_no_leaks()
    assert core(ngram).get_state()["num_free_blocks"] == core(ngram).num_blocks - 1


@pytest.mark.slow
def test_no_compilation_and_other_requests_unchanged_beside_drafted_ones(plain, ngram):
    """Drafted requests share steps with ones that get no drafts (penalties, logprobs,
    min_p and logit bias, a grammar): every output equals decoding without speculation, and
    no step compiles."""
    ngram.chat(CHATS[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # grammar backend
    compiled = num_compilations()
    mixes = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0.7, min_p=0.05, logit_bias={13: 2.0}, seed=1,
                       max_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(regex="(fox|dog)( (fox|dog))*")),
    ]  # fmt: skip
    chats = [CHATS[i % 2] for i in range(len(mixes))]
    want = plain.chat(chats, mixes, use_tqdm=False)
    got = ngram.chat(chats, mixes, use_tqdm=False)
    assert num_compilations() == compiled
    assert token_ids(got) == token_ids(want)
    lp_got, lp_want = got[2].outputs[0].logprobs, want[2].outputs[0].logprobs
    assert [sorted(p) for p in lp_got] == [sorted(p) for p in lp_want]
    core(ngram).scheduler.kv_cache_manager.check_no_leaks()


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
    position, the token frequencies over 3000 samples agree (chi-square, p > 0.001). Every
    token occurs in the prompt, so nearly every step is drafted; about a tenth of the drafts
    are accepted, so both branches of the rejection rule are exercised. (Keeping the sample of
    the row after a rejected draft instead gives p < 1e-11 at positions 1 and 2.)"""
    prompt = [*range(1, 16), *range(15, 0, -1), 3, 7, 1, 9]
    params = SamplingParams(temperature=0.8, top_k=10, max_tokens=4, ignore_eos=True)
    engine = dict(model=str(tiny_dir), max_num_seqs=64, max_num_batched_tokens=512,
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
    counter = AcceptCounter(spec)
    positions = [1, 2, 3]  # token 0 comes from the prompt's last position: never drafted
    with_spec = token_counts(spec, prompt, params, 3000, positions)
    assert 0.05 < counter.accepted / counter.drafted < 0.9, vars(counter)
    without = token_counts(plain, prompt, params, 3000, positions)
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
