"""kv_transfer_params through the frontend, over a stand-in engine core: a request's reach its
EngineCoreRequest (every child of n > 1) only in the proxy's shape and naming an allowed host,
a finished output's reach the RequestOutput (the first child's), offline (LLMEngine,
LLM.generate) and in AsyncLLM."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from jaxserve.config import DEFAULT_KV_TRANSFER_ALLOWED_HOSTS
from jaxserve.config.engine import CacheConfig
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.entrypoints.llm import LLM
from jaxserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from jaxserve.ipc.serialization import MsgpackDecoder, MsgpackEncoder
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


def config(max_model_len: int = 64):
    """What the frontend reads of an EngineConfig (a model of 100 tokens, no tokenizer)."""
    return SimpleNamespace(
        model=SimpleNamespace(vocab_size=100, hf_config=None, hidden_size=8),
        scheduler=SimpleNamespace(max_model_len=max_model_len),
        parallel=SimpleNamespace(data_parallel_size=1),
        cache=CacheConfig(),  # blocks of 16, prefix caching on
        max_logprobs=20,
        pooler=None,
        reasoning_parser=None,
        model_path="fake",
        kv_transfer_allowed_hosts=DEFAULT_KV_TRANSFER_ALLOWED_HOSTS,
        generation_config="vllm",  # no default sampling parameters
        override_generation_config={},
        lora=None,  # no --enable-lora
    )


def handed_back(request: EngineCoreRequest) -> dict | None:
    """What the stand-in core's KV connector hands on for a request."""
    if request.kv_transfer_params is None:
        return None
    return {"do_remote_prefill": True, "remote_engine_id": "fake", "of": request.request_id}


class FakeCore:
    """An engine core stand-in: each request finishes at once with one token, its output
    carrying `cached` cached prompt tokens and handed_back(request)."""

    client_index = 0
    dead = None

    def __init__(self, cached: int = 0):
        self.cached = cached
        self.requests: list[EngineCoreRequest] = []
        self.pending: list[EngineCoreOutput] = []

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for r in requests:  # over the wire, as the real clients send them (arrays too)
            frames = [bytes(f) for f in MsgpackEncoder().encode(r)]
            r = MsgpackDecoder(EngineCoreRequest).decode(frames)
            self.requests.append(r)
            out = EngineCoreOutput(r.request_id, [7], "length", num_cached_tokens=self.cached)
            out.kv_transfer_params = handed_back(r)
            self.pending.append(out)

    def add_request_groups(self, groups: list[list[EngineCoreRequest]]) -> None:
        for requests in groups:
            self.add_requests(requests)

    def get_output(self) -> EngineCoreOutputs:
        outputs, self.pending = self.pending, []
        return EngineCoreOutputs(outputs)

    async def get_output_async(self) -> EngineCoreOutputs:
        while not self.pending:
            await asyncio.sleep(0.001)
        return self.get_output()

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def poll_dead(self) -> None:
        return None

    def engine_of(self, request_id: str) -> int:
        return 0

    def shutdown(self) -> None:
        pass


def test_input_processor_puts_them_on_the_request_and_children_keep_them():
    processor = InputProcessor.from_config(config(), None)
    request = processor.process("r", [1, 2, 3], SamplingParams(n=3), kv_transfer_params=PREFILL)
    assert request.kv_transfer_params == PREFILL
    children = OutputProcessor(None).add_request(None, request)
    assert [c.kv_transfer_params for c in children] == [PREFILL] * 3
    assert processor.process("s", [1], SamplingParams()).kv_transfer_params is None
    with pytest.raises(ValueError, match="kv_transfer_params must be an object"):
        processor.process("t", [1], SamplingParams(), kv_transfer_params=[1])  # type: ignore[arg-type]


# What the proxy sends a prefill instance, and what a producer's response hands on to a decoder.
PROXY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
PRODUCER_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_engine_id": "e1", "remote_block_ids": None,
                   "remote_host": "127.0.0.1", "remote_port": 14579}  # fmt: skip


@pytest.mark.parametrize(
    "params, message",
    [
        # the issue's: a port that is no number (reached int() on the scheduler's thread)
        ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "abc"},
         r"Expected `int \| null`, got `str` - at `\$.remote_port`"),
        ({**PRODUCER_ANSWER, "remote_port": 2**64}, r"<= 65535 - at `\$.remote_port`"),
        ({**PRODUCER_ANSWER, "remote_port": 0}, r">= 1 - at `\$.remote_port`"),
        ({**PRODUCER_ANSWER, "remote_port": 14579.0}, "got `float`"),
        ({**PRODUCER_ANSWER, "remote_host": ""}, "length >= 1"),
        ({**PRODUCER_ANSWER, "remote_host": {"a": [1]}}, "got `object`"),
        ({**PRODUCER_ANSWER, "remote_block_ids": [1, 2]}, r"\$.remote_block_ids"),
        ({"do_remote_decode": 1}, "Expected `bool`"),
        ({"do_remote_decode": True, "extra": 1}, "unknown field `extra`"),
        ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "needs remote_host and"),
        ({**PRODUCER_ANSWER, "do_remote_decode": True}, "exclusive"),
        # any host but this machine: refused, naming the flag that allows it
        ({**PRODUCER_ANSWER, "remote_host": "x"},
         r"remote_host 'x' is not allowed: .* --kv-transfer-allowed-hosts \(127.0.0.1, ::1, "),
        ({**PRODUCER_ANSWER, "remote_host": "10.0.0.5"}, "--kv-transfer-allowed-hosts"),
    ],
)  # fmt: skip
def test_input_processor_refuses_any_other_shape_and_other_hosts(params, message):
    processor = InputProcessor.from_config(config(), None)
    with pytest.raises(ValueError, match=message):
        processor.process("r", [1, 2, 3], SamplingParams(), kv_transfer_params=params)


def test_input_processor_takes_the_proxys_shape_and_listed_hosts():
    processor = InputProcessor.from_config(config(), None)
    for params in (PROXY_PREFILL, PRODUCER_ANSWER, {"do_remote_decode": True},
                   {**PRODUCER_ANSWER, "remote_host": "LocalHost"},
                   {**PRODUCER_ANSWER, "remote_host": "::1"}):  # fmt: skip
        request = processor.process("r", [1], SamplingParams(), kv_transfer_params=params)
        assert request.kv_transfer_params == params
    cross_host = InputProcessor.from_config(
        SimpleNamespace(**{**vars(config()), "kv_transfer_allowed_hosts": ("10.0.0.5",)}), None
    )
    remote = {**PRODUCER_ANSWER, "remote_host": "10.0.0.5"}
    assert cross_host.process("r", [1], SamplingParams(), kv_transfer_params=remote)
    with pytest.raises(ValueError, match="not allowed"):  # the list replaces the default
        cross_host.process("r", [1], SamplingParams(), kv_transfer_params=PRODUCER_ANSWER)


def test_output_processor_hands_on_the_first_childs_when_finished():
    processor = OutputProcessor(None)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    request = InputProcessor.from_config(config(), None).process("r", [1, 2], params)
    processor.add_request(None, request)
    first = [EngineCoreOutput("1_r", [5], "length", kv_transfer_params={"child": 1}),
             EngineCoreOutput("0_r", [5], None, num_cached_tokens=16)]  # fmt: skip
    assert processor.process_outputs(first)[0] == []  # FINAL_ONLY: nothing yet
    last = EngineCoreOutput("0_r", [6], "length", kv_transfer_params={"child": 0})
    (out,), _ = processor.process_outputs([last])
    assert out.finished and out.kv_transfer_params == {"child": 0}
    assert out.num_cached_tokens == 16


def test_llm_engine_and_llm_generate_take_and_return_them():
    core = FakeCore()
    engine = LLMEngine(config(), client=core)
    engine.add_request(
        "a", {"prompt_token_ids": [1, 2]}, SamplingParams(), kv_transfer_params=PREFILL
    )
    (out,) = engine.step()
    assert core.requests[0].kv_transfer_params == PREFILL
    assert out.kv_transfer_params == handed_back(core.requests[0])

    llm = object.__new__(LLM)  # an LLM over the stand-in core
    llm.llm_engine, llm._counter = engine, itertools.count()
    prompts = [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}]
    outs = llm.generate(
        prompts, SamplingParams(), use_tqdm=False, kv_transfer_params=[PREFILL, None]
    )
    assert [r.kv_transfer_params for r in core.requests[1:]] == [PREFILL, None]
    assert outs[0].kv_transfer_params is not None and outs[1].kv_transfer_params is None
    with pytest.raises(ValueError, match="1 kv_transfer_params for 2 prompts"):
        llm.generate(prompts, SamplingParams(), use_tqdm=False, kv_transfer_params=[PREFILL])


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_async_llm_generate_takes_and_returns_them(kind):
    async def main():
        core = FakeCore(cached=32)
        llm = AsyncLLM(config(), core)
        params = SamplingParams(output_kind=kind)
        outs = [o async for o in llm.generate({"prompt_token_ids": [1, 2]}, params, "r",
                                              kv_transfer_params=PREFILL)]  # fmt: skip
        llm.shutdown()
        return core, outs

    core, outs = asyncio.run(main())
    assert core.requests[0].kv_transfer_params == PREFILL
    assert outs[-1].finished and outs[-1].kv_transfer_params == handed_back(core.requests[0])
    assert outs[-1].num_cached_tokens == 32
