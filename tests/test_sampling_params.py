import re

import msgspec
import pytest

from jaxserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
        ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
        ("prompt_logprobs", -3), ("stop", [""]), ("n", 129), ("seed", 2**63),
        ("seed", -(2**63) - 1), ("seed", 2**70),
    ],
)  # fmt: skip
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*got {re.escape(repr(value))}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens=4, got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_defaults_normalisation_and_msgpack_round_trip():
    p = SamplingParams(stop="###", top_k=-1, temperature=0.0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy
    assert SamplingParams().max_tokens == 16 and not SamplingParams().greedy
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert again == p


@pytest.mark.parametrize("bias", [101.0, -100.5, float("inf"), float("nan")])
def test_logit_bias_values_are_finite_and_within_100(bias):
    with pytest.raises(ValueError, match=r"^logit_bias must be in \[-100, 100\] \(token 7\)"):
        SamplingParams(logit_bias={7: bias})
    assert SamplingParams(logit_bias={7: 100.0, 8: -100.0}).logit_bias[8] == -100.0


def test_child_seeds_count_on_and_wrap_at_64_bits():
    assert SamplingParams(seed=5).child_seed(2) == 7
    assert SamplingParams(seed=2**63 - 1).child_seed(1) == -(2**63)
    assert SamplingParams(seed=-1).child_seed(1) == 0
    assert SamplingParams().child_seed(3) is None
