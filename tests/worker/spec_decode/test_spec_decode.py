"""Speculative decoding end to end: exact greedy and seeded output on the default model, the
target distribution on a tiny one, no compilation after warm-up, no leaked blocks."""

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.worker.executables import num_compilations
from tests.helpers import engines_in_process

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
    with engines_in_process():
        yield


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
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    stop = SamplingParams(temperature=0.0, max_tokens=32, stop=["farm"], min_tokens=3)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=32, seed=7)
    # the rewrite stops at "farm", inside a run of accepted drafts; the rest run to 32
    for params in [[stop, greedy, greedy, greedy], sampled]:
        want = plain.chat(CHATS, params, use_tqdm=False)
        got = ngram.chat(CHATS, params, use_tqdm=False)
        assert token_ids(got) == token_ids(want)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in want
        ]
        if params is not sampled:
            assert got[0].outputs[0].stop_reason == "farm"
    # The rewrite and the repetition are mostly drafts, accepted.
    assert counter.accepted > 45 and counter.accepted / counter.drafted > 0.4  # 71 / 107
    core(ngram).scheduler.kv_cache_manager.check_no_leaks()
    assert core(ngram).get_state()["num_free_blocks"] == core(ngram).num_blocks - 1


@pytest.mark.slow
def test_no_compilation_and_other_requests_unchanged_beside_drafted_ones(plain, ngram):
    """Drafted requests (with penalties, logprobs, min_p and logit bias, a grammar) share
    steps: every output equals decoding without speculation, logprobs included (one per
    token, accepted drafts' too), and no step compiles."""
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
    assert len(lp_got) == len(got[2].outputs[0].token_ids) == 20
    assert [sorted(p) for p in lp_got] == [sorted(p) for p in lp_want]
    values = [[p[t].logprob for t in sorted(p)] for p in lp_got]
    np.testing.assert_allclose(values, [[p[t].logprob for t in sorted(p)] for p in lp_want],
                               atol=1e-3)  # fmt: skip
    assert got[2].outputs[0].cumulative_logprob == pytest.approx(
        want[2].outputs[0].cumulative_logprob, abs=1e-2
    )
    counter = AcceptCounter(ngram)  # a logprobs request alone is drafted, and accepts drafts
    alone = ngram.chat(chats[2:3], mixes[2], use_tqdm=False)[0].outputs[0]
    assert counter.accepted > 0 and alone.token_ids == got[2].outputs[0].token_ids
    assert [sorted(p) for p in alone.logprobs] == [sorted(p) for p in lp_want]
    # Penalised requests are drafted too: each draft row counts the drafts before it, and a
    # seeded sampled one reproduces bit for bit.
    penalised = [
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, max_tokens=40, frequency_penalty=0.5,
                       presence_penalty=0.3, seed=3),
    ]  # fmt: skip
    counter = AcceptCounter(ngram)
    got = ngram.chat(CHATS[:2], penalised, use_tqdm=False)
    assert token_ids(got) == token_ids(plain.chat(CHATS[:2], penalised, use_tqdm=False))
    assert counter.accepted > 0, vars(counter)  # penalties make the prompt's text less likely
    # A constrained request is drafted too: drafts are cut to what its grammar accepts and
    # each draft row is masked as the grammar stands after the drafts before it.
    sentence = "The quick brown fox jumps over the lazy dog. The lazy dog sleeps"
    params = SamplingParams(temperature=0.0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex=sentence))  # fmt: skip
    counter = AcceptCounter(ngram)
    got = ngram.chat(CHATS[1:2], params, use_tqdm=False)[0].outputs[0]
    want = plain.chat(CHATS[1:2], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == sentence
    assert counter.accepted > 5, vars(counter)
    core(ngram).scheduler.kv_cache_manager.check_no_leaks()
    core(ngram).scheduler.kv_cache_manager.check_no_leaks()
