"""Speculative decoding end to end: exact greedy and seeded output on the default model, the
target distribution on a tiny one, no compilation after warm-up, no leaked blocks."""

import re

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.metrics.prometheus import PrometheusStatLogger
from jaxserve.metrics.stats import IterationStats
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.worker.executables import num_compilations
from tests.helpers import core_of, engines_in_process

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
    return core_of(llm)


class AcceptCounter:
    """Sums the scheduler's speculative-decoding stats over every step (each snapshot
    resets them), and feeds them to a Prometheus logger as the server's output handler does
    (`metrics()`: the /metrics text's spec_decode lines)."""

    def __init__(self, llm):
        self.drafted = self.accepted = 0
        self.prometheus = PrometheusStatLogger("m")
        sched = core(llm).scheduler
        make = sched.make_stats

        def counting():
            stats = make()
            self.drafted += stats.spec_decoding.num_draft_tokens
            self.accepted += stats.spec_decoding.num_accepted_tokens
            self.prometheus.record(stats, IterationStats())
            return stats

        sched.make_stats = counting

    def metrics(self) -> dict[str, float]:
        """The spec_decode counters as /metrics shows them (name -> value)."""
        text = self.prometheus.exposition().decode()
        line = r'^vllm:(spec_decode_num_\w+)_total\{engine="0",model_name="m"\} (\S+)$'
        found = re.findall(line, text, re.M)
        return {name: float(value) for name, value in found}


def record_drafts(runner) -> list[tuple[list[int], list[int]]]:
    """(a request's tokens, the drafts proposed after them), as the engine saw them, for every
    proposal from now on; the runner drafts at every chance (no backoff)."""
    proposed = []
    propose = runner.drafting.propose

    def recording(batch, final_row, ib, drafts):
        out = propose(batch, final_row, ib, drafts)
        for req_id, d in out.items():
            row = ib.req_id_to_row[req_id]
            proposed.append((ib.token_ids[row, : ib.num_tokens[row]].tolist(), d))
        return out

    runner.drafting.propose = recording
    runner.drafting.backoff.should_draft = lambda req_id: True
    return proposed


@pytest.fixture(scope="module")
def plain():
    return LLM(**SMALL)


@pytest.fixture(scope="module")
def ngram():
    return LLM(**SMALL, speculative_config=NGRAM)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_greedy_outputs_equal_decoding_without_speculation(plain, ngram):
    """Greedy drafted requests (a stop string, short and long prompts) give the tokens, text
    and finish reasons of decoding without speculation. (Seeded sampled ones, top-k / top-p
    and penalties among them: the test below.)"""
    counter = AcceptCounter(ngram)
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    stop = SamplingParams(temperature=0.0, max_tokens=32, stop=["farm"], min_tokens=3)
    # the rewrite stops at "farm", inside a run of accepted drafts; the rest run to 32
    params = [stop, greedy, greedy, greedy]
    want = plain.chat(CHATS, params, use_tqdm=False)
    got = ngram.chat(CHATS, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert got[0].outputs[0].stop_reason == "farm"
    # The rewrite and the repetition are mostly drafts, accepted.
    assert counter.accepted > 25 and counter.accepted / counter.drafted > 0.5  # 35 / 52
    core(ngram).scheduler.kv_cache_manager.check_no_leaks()
    assert core(ngram).get_state()["num_free_blocks"] == core(ngram).num_blocks - 1


@pytest.mark.slow
def test_no_compilation_and_other_requests_unchanged_beside_drafted_ones(plain, ngram):
    """Drafted requests (with penalties, logprobs, seeded sampling through top-k, top-p,
    min_p and logit bias, a grammar) share steps: every output equals decoding without
    speculation, logprobs included (one per token, accepted drafts' too), and no step
    compiles."""
    ngram.chat(CHATS[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # grammar backend
    compiled = num_compilations()
    mixes = [
        SamplingParams(temperature=0.0, max_tokens=14),
        SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=14, logprobs=3),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, logit_bias={13: 2.0},
                       seed=1, max_tokens=14),
        SamplingParams(temperature=0.0, max_tokens=14,
                       structured_outputs=StructuredOutputsParams(regex="(fox|dog)( (fox|dog))*")),
    ]  # fmt: skip
    chats = [CHATS[i % 2] for i in range(len(mixes))]
    # Penalised requests are drafted too: each draft row counts the drafts before it, and a
    # seeded sampled one reproduces bit for bit.
    penalised = [
        SamplingParams(temperature=0.0, max_tokens=28, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, max_tokens=28, frequency_penalty=0.5,
                       presence_penalty=0.3, seed=3),
    ]  # fmt: skip
    # A constrained request is drafted too: drafts are cut to what its grammar accepts and
    # each draft row is masked as the grammar stands after the drafts before it.
    sentence = "The quick brown fox jumps over the lazy dog. The lazy dog sleeps"
    regex = StructuredOutputsParams(regex=sentence)
    constrained = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=regex)
    # every reference in one batch (without speculation, a request's tokens do not depend on
    # its batch: tests/entrypoints/test_llm.py)
    want = plain.chat([*chats, *CHATS[:2], CHATS[1]], [*mixes, *penalised, constrained],
                      use_tqdm=False)  # fmt: skip
    want, want_penalised, (want_constrained,) = want[:5], want[5:7], want[7:]
    got = ngram.chat(chats, mixes, use_tqdm=False)
    assert num_compilations() == compiled
    assert token_ids(got) == token_ids(want)
    lp_got, lp_want = got[2].outputs[0].logprobs, want[2].outputs[0].logprobs
    assert len(lp_got) == len(got[2].outputs[0].token_ids) == 14
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
    counter = AcceptCounter(ngram)
    got = ngram.chat(CHATS[:2], penalised, use_tqdm=False)
    assert token_ids(got) == token_ids(want_penalised)
    assert counter.accepted > 0, vars(counter)  # penalties make the prompt's text less likely
    counter = AcceptCounter(ngram)
    got = ngram.chat(CHATS[1:2], constrained, use_tqdm=False)[0].outputs[0]
    want = want_constrained.outputs[0]
    assert got.token_ids == want.token_ids and got.text == sentence
    assert counter.accepted > 5, vars(counter)
    core(ngram).scheduler.kv_cache_manager.check_no_leaks()
