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


def _processor():
    from jaxserve.engine.input_processor import InputProcessor

    return InputProcessor(None, vocab_size=1000, max_model_len=128, max_logprobs=20,
                          eos_token_id=2)  # fmt: skip


@pytest.mark.parametrize("value", [2**31, 2**63, -1])
@pytest.mark.parametrize(
    "field",
    ["top_k", "min_tokens", "max_tokens", "stop_token_ids", "allowed_token_ids", "logit_bias",
     "bad_words_token_ids", "priority", "n", "logprobs", "prompt_logprobs", "seed",
     "truncate_prompt_tokens"],
)  # fmt: skip
def test_integers_at_int32_int64_and_minus_one_are_refused_or_capped(field, value):
    """Through the Python API (SamplingParams, then the InputProcessor): a ValueError naming
    the field, or vLLM's reading of the value; what is accepted fits the device arrays."""
    from jaxserve.ipc.messages import EngineCoreRequest
    from jaxserve.worker.sampling_rows import SamplingRows

    lists = {"stop_token_ids": [value], "allowed_token_ids": [value],
             "logit_bias": {value: 1.0}, "bad_words_token_ids": [[value]]}  # fmt: skip
    kwargs = {"max_tokens": None, field: lists.get(field, value)}
    priority = kwargs.pop("priority", 0)
    accepted = {("top_k", 2**31): 0, ("top_k", -1): 0, ("seed", 2**31): 2**31,
                ("seed", -1): -1, ("priority", 2**31): 2**31, ("priority", -1): -1,
                ("truncate_prompt_tokens", -1): -1}  # fmt: skip
    if (field, value) not in accepted:
        with pytest.raises(ValueError, match=field.removesuffix("_token_ids")):
            _processor().process("r", [5, 6], SamplingParams(**kwargs), priority=priority)
        return
    request = _processor().process("r", [5, 6], SamplingParams(**kwargs), priority=priority)
    request = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    got = request.priority if field == "priority" else getattr(request.sampling_params, field)
    assert got == accepted[field, value]
    SamplingRows(1).add(0, request.sampling_params, 2)  # no overflow writing the row


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    processor = _processor()
    params = SamplingParams(truncate_prompt_tokens=2)
    assert processor.process("r", [5, 6, 7, 8], params).prompt_token_ids == [7, 8]
    with pytest.raises(ValueError, match="greater than max_model_len"):
        processor.process("r", [5], SamplingParams(truncate_prompt_tokens=129))
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=0)
