"""Beam search: LLM.beam_search equals HF generate(num_beams=...) on a tiny model (ignore_eos:
beams of one length, where vLLM's and HF's length normalisations agree); EOS ends a beam;
vLLM's ranking counts the prompt in the length; the beams share the prompt's blocks; bad
parameters name themselves; /v1/completions' use_beam_search."""

import pytest
import torch
import transformers

from jaxserve.entrypoints.beam_search import BeamSearch, beam_search_score
from jaxserve.entrypoints.llm import LLM
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import BeamSearchParams
from tests.helpers import core_of, make_tiny_hf

PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 120, 64]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")  # the test reads its prefix-cache counts
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=16, max_num_batched_tokens=128)
    mp.undo()
    yield llm
    llm.llm_engine.shutdown()


def test_beams_equal_hf_beam_search(llm, model_dir):
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), num_beams=3, num_return_sequences=3, max_new_tokens=6,
                do_sample=False, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        assert [s.output_token_ids for s in out.sequences] == [
            seq[len(prompt) :].tolist() for seq in ref.sequences
        ]
        for beam, score in zip(out.sequences, ref.sequences_scores, strict=True):
            assert beam.tokens[: len(prompt)] == prompt and len(beam.logprobs) == 6
            assert beam.cum_logprob == pytest.approx(float(score) * 6, abs=1e-3)  # HF: / 6
            assert beam.finish_reason == "length"


def test_the_beams_share_the_prompts_blocks(llm, monkeypatch):
    kv = core_of(llm).scheduler.kv_cache_manager
    hits, lookup = [], kv.get_computed_blocks

    def counted(request, *trim):
        hit = lookup(request, *trim)
        hits.append(hit[1])
        return hit

    monkeypatch.setattr(kv, "get_computed_blocks", counted)
    prompt = [(11 * i) % 200 + 3 for i in range(40)]  # 2 full blocks of 16, then 8 tokens
    llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=3))
    assert hits[0] == 0 and hits[1:] == [32] * 4  # steps 2 and 3: both beams hit 2 blocks


def fake_step(candidates: dict[int, float]) -> RequestOutput:
    """A one-token output whose top logprobs are `candidates` (token -> logprob)."""
    position = {t: Logprob(lp, i + 1, None) for i, (t, lp) in enumerate(candidates.items())}
    completion = CompletionOutput(0, "", [next(iter(candidates))], -1.0, [position], "length")
    return RequestOutput("r", None, [], None, [completion], finished=True)


def test_eos_ends_a_beam_and_the_ranking_counts_the_prompt():
    eos = 2
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    search = BeamSearch([[9, 9, 9]], params, eos, max_model_len=64)
    search.advance([fake_step({eos: -0.5, 5: -0.7, 6: -3.0})])  # EOS first: that beam is done
    assert [b.tokens for b in search.beams[0]] == [[9, 9, 9, 5], [9, 9, 9, 6]]
    assert [(b.tokens, b.finish_reason) for b in search.completed[0]] == [([9, 9, 9, 2], "stop")]
    search.advance([fake_step({5: -0.6, 7: -0.7}), fake_step({5: -0.6, 8: -5.0})])
    search.advance([fake_step({5: -0.6, 7: -0.7}), fake_step({5: -0.6, 8: -0.7})])
    assert search.done
    best = search.results()[0].sequences
    # vLLM's score: cum / (length with the prompt, EOS not counted): -0.5 / 3 beats -1.9 / 6
    # (divided by the generated length only, as HF does, -1.9 / 3 would lose to -0.5 / 0)
    assert best[0].tokens == [9, 9, 9, 2] and best[0].finish_reason == "stop"
    assert best[1].tokens == [9, 9, 9, 5, 5, 5] and best[1].cum_logprob == pytest.approx(-1.9)
    assert beam_search_score([9, 9, 9, 2], -0.5, eos, 1.0) == pytest.approx(-0.5 / 3)
    assert beam_search_score([9, 9, 9, 5], -1.0, eos, 2.0) == pytest.approx(-1.0 / 16)


def test_a_length_penalty_ranks_the_shorter_beam_first_or_last():
    eos = 2
    long_score = beam_search_score([1] * 10, -2.0, eos, 1.0)
    short_score = beam_search_score([1, 1, 1, 1, eos], -1.5, eos, 1.0)
    assert short_score < long_score  # -1.5 / 4 < -2 / 10
    assert beam_search_score([1, 1, 1, 1, eos], -1.5, eos, 0.0) > beam_search_score(
        [1] * 10, -2.0, eos, 0.0
    )  # no normalisation: the higher cumulative logprob wins


def test_bad_parameters_name_themselves(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="beam_width 11 needs 22 logprobs"):
        llm.beam_search("hi", BeamSearchParams(beam_width=11, max_tokens=2))
