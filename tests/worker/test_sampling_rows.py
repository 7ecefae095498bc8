"""Per-row sampling arrays: written once per request, gathered per step exactly as the rows'
SamplingParams say, with min_tokens' blocks only while a row is under min_tokens."""

import numpy as np

from jaxserve.layers.sampler import SamplerVariant
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampling_rows import SamplingRows

EOS = 2


def test_a_rows_parameters_are_gathered_and_padded_with_greedy_rows():
    rows = SamplingRows(4)
    hot = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, seed=-1,
                         presence_penalty=0.5, logprobs=2)  # fmt: skip
    rows.add(3, hot, EOS)
    rows.add(1, SamplingParams(temperature=0.0), EOS)
    md, variant = rows.metadata(np.array([3, 1, 3]), np.zeros(3, np.int32), 4, np.zeros((4, 1)))
    assert md.temperature.tolist() == [np.float32(0.8), 0.0, np.float32(0.8), 0.0]
    assert md.top_k.tolist() == [5, 0, 5, 0] and md.repetition_penalty.tolist() == [1.0] * 4
    assert md.seeds.tolist() == [2**32 - 1, 0, 2**32 - 1, 0]  # -1 % 2**64, low word
    assert md.seeds_hi.tolist() == [2**32 - 1, 0, 2**32 - 1, 0]
    assert md.has_seed.tolist() == [True, False, True, False]
    assert variant == SamplerVariant.of([hot, SamplingParams(temperature=0.0), hot])
    assert variant.penalties and variant.logprobs and variant.greedy and not variant.bias


def test_min_tokens_blocks_eos_and_stop_tokens_until_it_is_met():
    rows = SamplingRows(2)
    params = SamplingParams(min_tokens=2, stop_token_ids=[7], logit_bias={9: 1.5, 7: 3.0})
    rows.add(0, params, EOS)
    for out_pos, blocked in ((0, True), (1, True), (2, False)):
        md, variant = rows.metadata(np.array([0]), np.array([out_pos]), 1, np.zeros((1, 1)))
        bias = {
            int(t): float(v)
            for t, v in zip(md.bias_token_ids[0], md.bias_values[0], strict=True)
            if t >= 0
        }
        assert bias == ({9: 1.5, 7: -np.inf, EOS: -np.inf} if blocked else {9: 1.5, 7: 3.0})
        assert variant.bias


def test_a_row_taken_by_a_new_request_forgets_the_old_one():
    rows = SamplingRows(1)
    rows.add(0, SamplingParams(logit_bias={5: 1.0}, repetition_penalty=1.2, prompt_logprobs=1), 0)
    rows.add(0, SamplingParams(), 0)
    md, variant = rows.metadata(np.array([0]), np.array([0]), 1, np.zeros((1, 1)))
    assert (md.bias_token_ids == -1).all() and not variant.bias and not variant.penalties
    assert not rows.penalised[0] and not rows.prompt_logprobs[0]


def _allowed(bitmask_row: np.ndarray, vocab: int) -> list[int]:
    bits = np.unpackbits(bitmask_row.astype("<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab]).tolist()


def test_allowed_token_ids_and_one_token_bad_words_mask_the_row():
    rows = SamplingRows(3)
    rows.add(0, SamplingParams(allowed_token_ids=[3, 40, 63, 31]), EOS)
    rows.add(1, SamplingParams(bad_words_token_ids=[[5], [31]]), EOS)
    rows.add(2, SamplingParams(), EOS)
    free = np.full((4, 2), -1, np.int32)  # V = 64
    md, variant = rows.metadata(np.array([0, 1, 2]), np.zeros(3, np.int32), 4, free)
    assert _allowed(md.token_bitmask[0], 64) == [3, 31, 40, 63]
    assert _allowed(md.token_bitmask[1], 64) == [t for t in range(64) if t not in (5, 31)]
    assert _allowed(md.token_bitmask[2], 64) == list(range(64))
    assert variant.structured and (free == -1).all()  # the shared free mask is untouched
    rows.add(0, SamplingParams(), EOS)  # a new request forgets the old one's mask
    md, variant = rows.metadata(np.array([0]), np.zeros(1, np.int32), 1, free[:1])
    assert _allowed(md.token_bitmask[0], 64) == list(range(64)) and not variant.structured


def test_a_longer_bad_word_blocks_its_last_token_after_its_other_tokens():
    rows = SamplingRows(1)
    rows.add(0, SamplingParams(bad_words_token_ids=[[7, 8, 9]]), EOS)
    token_ids = np.zeros((1, 16), np.int32)
    token_ids[0, :6] = [1, 2, 7, 8, 7, 8]  # a prompt of 2, then outputs 7 8 7 8
    free = np.full((4, 1), -1, np.int32)
    for out_pos, blocked in ((0, False), (1, False), (2, True), (3, False), (4, True)):
        md, _ = rows.metadata(np.array([0]), np.array([out_pos]), 4, free)
        bitmask = rows.blocked_bitmask(md, np.zeros(4, np.int32), 1, None, token_ids, [2])
        if blocked:
            assert _allowed(bitmask[0], 32) == [t for t in range(32) if t != 9]
            assert (bitmask[1:] == -1).all()
        else:
            assert bitmask is None
    grammar = np.array([[0b1000000000]], np.int32)  # the grammar allows 9 only
    md, _ = rows.metadata(np.array([0]), np.array([3]), 4, free)
    bitmask = rows.blocked_bitmask(md, np.zeros(4, np.int32), 1, grammar, token_ids, [2])
    assert _allowed(bitmask[0], 32) == [9]  # not blocked here: the grammar's mask stands
