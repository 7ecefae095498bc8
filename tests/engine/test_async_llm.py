"""AsyncLLM over the core process: many concurrent streams, cancellation. (A dead core under
AsyncLLM: tests/entrypoints/openai/test_api_server.py and test_scale_out.py.)"""

import asyncio

import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM, RequestOutputCollector
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers import make_tiny_hf

ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=128, max_model_len=128,
              num_gpu_blocks_override=256, async_scheduling=True)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny")))


def params(max_tokens, kind):
    return SamplingParams(temperature=0.8, seed=max_tokens, max_tokens=max_tokens,
                          ignore_eos=True, output_kind=kind)  # fmt: skip


def test_100_concurrent_streams_10_cancelled_the_rest_exact(model_dir):
    async def main():
        llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **ENGINE))
        try:
            started = {i: asyncio.Event() for i in range(100)}

            async def one(i):
                kind = RequestOutputKind.DELTA if i % 2 else RequestOutputKind.FINAL_ONLY
                n_tokens, outputs = 0, 0
                async for out in llm.generate({"prompt_token_ids": [1 + i % 50, 2, 3]},
                                              params(20 + i % 30, kind), f"r{i}"):  # fmt: skip
                    outputs += 1
                    n_tokens = (
                        n_tokens + len(out.outputs[0].token_ids)
                        if kind == 1
                        else len(out.outputs[0].token_ids)
                    )
                    started[i].set()
                    if out.finished:
                        assert out.outputs[0].finish_reason == "length"
                return n_tokens, outputs

            tasks = [asyncio.create_task(one(i)) for i in range(100)]
            cancelled = list(range(1, 20, 2))  # 10 DELTA streams, cut after their first output
            # (bounded: a stream that fails before its first output must not hang the test)
            await asyncio.wait_for(asyncio.gather(*(started[i].wait() for i in cancelled)), 120)
            for i in cancelled:
                tasks[i].cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for i, result in enumerate(results):
                if i in cancelled:
                    assert isinstance(result, asyncio.CancelledError)
                    continue
                n_tokens, outputs = result
                assert n_tokens == 20 + i % 30
                if i % 2 == 0:
                    assert outputs == 1  # FINAL_ONLY
            state = await llm.call_utility("get_state")  # runs check_no_leaks() in the core
            assert state["num_requests"] == 0
            assert state["num_free_blocks"] == state["num_blocks"] - 1
            assert not llm.output_processor.requests and not llm.collectors
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_collector_merges_deltas_for_a_slow_consumer():
    def out(text, ids, finished=False):
        c = CompletionOutput(0, text, ids, None, None, "length" if finished else None)
        return RequestOutput("r", None, [1], None, [c], finished)

    async def main():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        collector.put(out("a", [1]))
        collector.put(out("b", [2]))
        collector.put(out("c", [3], finished=True))
        merged = await collector.get()
        assert merged.outputs[0].text == "abc" and merged.outputs[0].token_ids == [1, 2, 3]
        assert merged.finished and merged.outputs[0].finish_reason == "length"
        cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        cumulative.put(out("a", [1]))
        cumulative.put(out("ab", [1, 2]))
        assert (await cumulative.get()).outputs[0].text == "ab"

    asyncio.run(main())
