"""allowed_token_ids and bad_words on a tiny random model: only allowed tokens are sampled, a
bad word's tokens never follow each other, and the requests beside them are unchanged."""

import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import engines_in_process, make_tiny_hf

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
              num_gpu_blocks_override=64, async_scheduling=True)  # fmt: skip
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with engines_in_process():
        llm = LLM(str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny"))), **ENGINE)
        yield llm
        llm.llm_engine.shutdown()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)


def test_only_allowed_tokens_are_sampled(llm):
    allowed = [3, 40, 41, 200]
    outs = llm.generate(
        [PROMPT] * 2,
        [SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True,
                        allowed_token_ids=allowed, n=2),
         greedy(allowed_token_ids=[77], logprobs=2)],
        use_tqdm=False,
    )  # fmt: skip
    sampled = [t for c in outs[0].outputs for t in c.token_ids]
    assert set(sampled) <= set(allowed) and len(set(sampled)) > 1
    assert outs[1].outputs[0].token_ids == [77] * 12


def test_bad_words_are_never_generated_and_leave_other_requests_alone(llm):
    (plain,) = llm.generate([PROMPT], greedy(), use_tqdm=False)
    g = plain.outputs[0].token_ids
    word = g[:2]  # the unconstrained output starts with this word
    outs = llm.generate(
        [PROMPT] * 3,
        [greedy(bad_words_token_ids=[word]), greedy(), greedy(bad_words_token_ids=[[g[0]]])],
        use_tqdm=False,
    )
    blocked = outs[0].outputs[0].token_ids
    assert blocked[0] == g[0] and blocked[1] != g[1]  # the same until the word's last token
    assert all(blocked[i : i + 2] != word for i in range(len(blocked) - 1))
    assert outs[1].outputs[0].token_ids == g  # the request beside them: unchanged
    assert g[0] not in outs[2].outputs[0].token_ids  # a one-token word: blocked everywhere
