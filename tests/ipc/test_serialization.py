"""Every message type survives encode -> frames -> decode, numpy arrays included."""

import numpy as np
import pytest

from jaxserve.ipc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)
from jaxserve.ipc.serialization import INLINE_THRESHOLD, MsgpackDecoder, MsgpackEncoder
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


def round_trip(obj, type_):
    frames = MsgpackEncoder().encode(obj)
    # What zmq delivers: independent byte strings (the encoder reuses its main buffer).
    received = [bytes(f) for f in frames]
    return MsgpackDecoder(type_).decode(received), len(frames)


def test_request_round_trips():
    params = SamplingParams(
        n=2, temperature=0.5, top_k=5, stop=["x"], logit_bias={3: -1.5}, seed=7,
        output_kind=RequestOutputKind.DELTA, prompt_logprobs=2,
    )  # fmt: skip
    request = EngineCoreRequest("r1", [1, 2, 3], params, eos_token_id=2, arrival_time=1.5,
                                priority=-1, cache_salt="s")  # fmt: skip
    decoded, n_frames = round_trip(request, EngineCoreRequest)
    assert decoded == request and n_frames == 1


@pytest.mark.parametrize("prompt_len", [3, 5000])  # inline, and a frame of its own
def test_outputs_with_arrays_round_trip(prompt_len):
    rng = np.random.default_rng(0)
    plp = (
        rng.standard_normal((prompt_len, 4)).astype(np.float32),
        rng.integers(0, 50000, (prompt_len, 4)).astype(np.int32),
        rng.integers(1, 100, prompt_len).astype(np.int32),
    )
    out = EngineCoreOutput("a", [5], finish_reason="stop", stop_reason=5,
                           logprobs=[([-0.1, -2.0], [5, 9], 1)], prompt_logprobs=plp,
                           num_cached_tokens=16)  # fmt: skip
    outputs = EngineCoreOutputs(
        [out, EngineCoreOutput("b", [])],
        SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25, num_preemptions=1),
        timestamp=12.5,
    )
    decoded, n_frames = round_trip(outputs, EngineCoreOutputs)
    assert n_frames == (1 if plp[0].nbytes < INLINE_THRESHOLD else 4)
    got = decoded.outputs[0]
    for a, b in zip(got.prompt_logprobs, plp, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    assert got.logprobs == out.logprobs and got.finish_reason == "stop"
    assert decoded.outputs[1] == outputs.outputs[1]
    assert decoded.scheduler_stats == outputs.scheduler_stats and decoded.timestamp == 12.5


def test_utility_messages_round_trip():
    call, _ = round_trip(UtilityRequest(3, "reset_prefix_cache", [1, "x"]), UtilityRequest)
    assert call == UtilityRequest(3, "reset_prefix_cache", [1, "x"])
    big = np.arange(10000, dtype=np.int64).reshape(100, 100)
    reply, n_frames = round_trip(EngineCoreOutputs(utility_output=UtilityOutput(3, big)),
                                 EngineCoreOutputs)  # fmt: skip
    np.testing.assert_array_equal(reply.utility_output.result, big)
    assert n_frames == 2
    failed, _ = round_trip(UtilityOutput(4, failure_message="boom"), UtilityOutput)
    assert failed.failure_message == "boom" and failed.result is None


def test_unserializable_values_name_the_type():
    with pytest.raises(TypeError, match="object"):
        MsgpackEncoder().encode(UtilityOutput(1, np.array([object()])))
    with pytest.raises((TypeError, NotImplementedError), match="cannot serialize object"):
        MsgpackEncoder().encode(UtilityOutput(1, object()))
