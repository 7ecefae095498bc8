"""One request that fails in the frontend's output processing (its detokenizer) or in the core
(finish_reason "error") fails alone: AsyncLLM's generator for it raises RequestFailedError
with the error, its children still in the core are aborted, the requests beside it finish
with their exact output, and the engine keeps serving. Over a stand-in engine core (no model)
and the bundled tokenizer."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from jaxserve.engine import detokenizer
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import RequestFailedError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import FakeCore, config

POISON = 99  # a token the injected detokenizer fault chokes on
CORE_ERROR = "RuntimeError: injected in the engine core"


class StepCore(FakeCore):
    """An engine core stand-in: every get_output gives each live request its next token
    (request i's k-th token: 300 + 10 i + k) until max_tokens ("length"). A request whose
    prompt starts with POISON gets POISON as its second token; one whose prompt starts with
    POISON + 1 fails in the core at its second step (finish_reason "error")."""

    def __init__(self):
        self.live: dict[str, tuple[EngineCoreRequest, int]] = {}  # id -> (request, tokens)
        self.aborted: list[str] = []
        self.added = 0

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for r in requests:
            r = msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=EngineCoreRequest)
            self.live[r.request_id] = (r, 0)
            self.added += 1

    def get_output(self) -> EngineCoreOutputs:
        outputs = []
        for req_id, (r, n) in list(self.live.items()):
            first = r.prompt_token_ids[0]
            if first == POISON + 1 and n == 1:
                outputs.append(EngineCoreOutput(req_id, [], "error", CORE_ERROR))
                del self.live[req_id]
                continue
            token = POISON if first == POISON and n == 1 else 300 + 10 * self.index(r) + n
            done = n + 1 == r.sampling_params.max_tokens
            outputs.append(EngineCoreOutput(req_id, [token], "length" if done else None))
            if done:
                del self.live[req_id]
            else:
                self.live[req_id] = (r, n + 1)
        return EngineCoreOutputs(outputs)

    @staticmethod
    def index(r: EngineCoreRequest) -> int:
        return r.prompt_token_ids[-1] % 10

    async def get_output_async(self) -> EngineCoreOutputs:
        while not self.live:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.001)  # a step's time: the streams interleave
        return self.get_output()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for r in request_ids:
            self.live.pop(r, None)


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)  # the bundled default model's


@pytest.fixture
def poisoned_detokenizer(monkeypatch):
    """The detokenizer raises on POISON: a fault in one request's output processing."""
    update = detokenizer.IncrementalDetokenizer.update

    def failing_update(self, new_token_ids):
        if POISON in new_token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected in the detokenizer")
        return update(self, new_token_ids)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", failing_update)


def make_config(tokenizer):
    cfg = config(max_model_len=256)
    cfg.model.vocab_size = len(tokenizer)
    return cfg


def expected_tokens(i: int, max_tokens: int) -> list[int]:
    return [300 + 10 * i + k for k in range(max_tokens)]


def test_async_llm_fails_only_the_request_that_failed(tokenizer, poisoned_detokenizer):
    async def collect(llm, i, first, kind, n=1):
        params = SamplingParams(max_tokens=4 + i, output_kind=kind, n=n)
        outs = [o async for o in llm.generate({"prompt_token_ids": [first, 7, i]}, params, f"r{i}")]
        return outs[-1]

    async def main():
        core = StepCore()
        llm = AsyncLLM(make_config(tokenizer), core, tokenizer=tokenizer)
        kinds = [
            RequestOutputKind.DELTA,
            RequestOutputKind.FINAL_ONLY,
            RequestOutputKind.CUMULATIVE,
        ]
        results = await asyncio.gather(
            collect(llm, 0, 5, kinds[0]),
            collect(llm, 1, POISON, kinds[0]),  # fails in the output processor
            collect(llm, 2, 5, kinds[1]),
            collect(llm, 3, POISON + 1, kinds[2], n=2),  # one child fails in the core
            collect(llm, 4, 5, kinds[2]),
            return_exceptions=True,
        )
        after = await collect(llm, 5, 5, kinds[1])  # the engine goes on
        llm.shutdown()
        return core, llm, results, after

    core, llm, results, after = asyncio.run(main())
    failed_here, failed_in_core = results[1], results[3]
    assert isinstance(failed_here, RequestFailedError)
    assert str(failed_here) == (
        "request r1 failed: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in "
        "position 0: injected in the detokenizer"
    )
    assert isinstance(failed_in_core, RequestFailedError)
    assert str(failed_in_core) == f"request r3 failed: {CORE_ERROR}"
    assert "r1" in core.aborted  # still running in the core: aborted there
    assert {"0_r3", "1_r3"} <= set(core.aborted)
    for i, out in [(0, results[0]), (2, results[2]), (4, results[4]), (5, after)]:
        (c,) = out.outputs
        assert out.finished and c.finish_reason == "length"
        if i == 0:  # DELTA: the last output carries only the last token
            continue
        assert c.token_ids == expected_tokens(i, 4 + i)
        assert c.text == tokenizer.decode(expected_tokens(i, 4 + i))
    assert not llm.errored and not llm.output_processor.requests and not llm.collectors
    assert not core.live


def test_llm_engine_returns_the_failed_request_finished_with_its_error(tokenizer):
    core = StepCore()
    engine = LLMEngine(make_config(tokenizer), client=core, tokenizer=tokenizer)
    for i, first in enumerate([5, POISON + 1, 5]):
        engine.add_request(f"r{i}", {"prompt_token_ids": [first, i]}, SamplingParams(max_tokens=3))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    failed = finished.pop("r1").outputs[0]
    assert (failed.finish_reason, failed.stop_reason, failed.token_ids) == ("error", CORE_ERROR, [])
    for i, out in ((0, finished["r0"]), (2, finished["r2"])):
        assert out.outputs[0].token_ids == expected_tokens(i, 3)
