"""A model over two processes through jax.distributed (CPU collectives over gloo): rank 0 is
the engine core of an `LLM`, rank 1 a `jaxserve serve --headless` follower; tp 3 splits 2 + 1
devices (one KV head each); same tokens as one process, and a lost rank ends every request with
an error within seconds."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxserve.distributed.mesh import devices_per_process
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.entrypoints.openai.test_api_server import free_ports
from tests.helpers import make_tiny_hf

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
              num_gpu_blocks_override=64)  # fmt: skip
PROMPTS = [{"prompt_token_ids": [1 + i, 2, 3 + 2 * i, 4, 5]} for i in range(6)]


def test_devices_per_process_share_evenly_first_ranks_take_the_rest():
    assert devices_per_process(2, 2) == [1, 1]
    assert devices_per_process(3, 2) == [2, 1]  # the default model's 9 heads over two hosts
    assert devices_per_process(8, 2) == [4, 4]


def start_follower(
    model_dir: str, port: int, log, *parallel: str, engine=ENGINE, env=None
) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    return subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", model_dir, "--headless",
         "--nnodes", "2", "--node-rank", "1", "--master-port", str(port),
         *(parallel or ("-tp", "3")), *flags],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pp_model_dir(tmp_path_factory):
    # 3 layers (stages of 2 and 1), 2 KV heads (one a device at tp 2), a tied LM head
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny-pp"), tie_word_embeddings=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 6 query heads, 3 KV heads: one KV head per device at tp 3, 2 on rank 0 and 1 on rank 1
    return str(
        make_tiny_hf(
            "llama",
            tmp_path_factory.mktemp("tiny"),
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=6,
            num_key_value_heads=3,
        )
    )


FOLLOWER_KV_GIB = 0.0005  # 512 KiB of KV cache a device: a few hundred of the tiny model's blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, logprobs=2,
                        prompt_logprobs=1, presence_penalty=0.5)  # fmt: skip


@pytest.mark.parametrize(
    "parallel",
    [
        {"tensor_parallel_size": 3},
        # a stage on each process (tp 2 each), the hand-off a collective between them; the
        # tied LM head moved from the first stage (rank 1's devices) to the last (rank 0's)
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    ],
    ids=["tp3", "tp2-pp2"],
)
def test_two_processes_give_one_processs_tokens_and_a_lost_rank_fails_fast(
    request, tmp_path, monkeypatch, parallel
):
    pipeline = "pipeline_parallel_size" in parallel
    model = request.getfixturevalue("pp_model_dir" if pipeline else "model_dir")
    one = LLM(model, **ENGINE)
    try:
        want = [one.generate(PROMPTS, p, use_tqdm=False) for p in (GREEDY, SEEDED)]
    finally:
        one.llm_engine.shutdown()

    port = free_ports(3)
    log = open(tmp_path / "follower.log", "w")  # noqa: SIM115 (closed below)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in parallel.items()]
    engine, env = ENGINE, None
    if pipeline:  # the cache sized by each rank's budget: the follower's is the smaller
        engine = {k: v for k, v in ENGINE.items() if k != "num_gpu_blocks_override"}
        monkeypatch.setenv("JAXSERVE_CPU_KVCACHE_SPACE", str(4 * FOLLOWER_KV_GIB))
        env = {**os.environ, "JAXSERVE_CPU_KVCACHE_SPACE": str(FOLLOWER_KV_GIB)}
    follower = start_follower(model, port, log, *flags, engine=engine, env=env)
    try:
        llm = LLM(model, nnodes=2, master_port=port, **parallel, **engine)
    except BaseException:
        follower.kill()
        raise
    try:
        config = llm.llm_engine.config.parallel
        assert config.nnodes == 2 and config.pipeline_parallel_size == (2 if pipeline else 1)
        if pipeline:  # the blocks that fit the follower's budget, not rank 0's 4x larger one
            (per_block,) = llm.collective_rpc("kv_bytes_per_block")
            state = llm.llm_engine.engine_core.call_utility("get_state")
            assert state["num_free_blocks"] + 1 == int(FOLLOWER_KV_GIB * 2**30) // per_block
        got = [llm.generate(PROMPTS, p, use_tqdm=False) for p in (GREEDY, SEEDED)]
        for mine, ref in zip(got, want, strict=True):
            for a, b in zip(mine, ref, strict=True):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                            strict=True)] for o in got[1]]  # fmt: skip
        ref = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                             strict=True)] for o in want[1]]  # fmt: skip
        assert max(abs(x - y) for a, b in zip(lp, ref, strict=True)
                   for x, y in zip(a, b, strict=True)) < 1e-3  # fmt: skip
        # the follower goes: every request ends with an error within seconds, none hangs
        engine = llm.llm_engine
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, long)
        engine.step()
        os.kill(follower.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 6
        core = engine.engine_core.proc
        core.wait(10)  # the engine core exits: its step may wait on the lost rank forever
    finally:
        llm.llm_engine.shutdown()
        follower.kill()
        follower.wait()
        log.close()


def test_rank_0_going_away_ends_the_follower(model_dir, tmp_path):
    port = free_ports(3)
    with open(tmp_path / "follower.log", "w") as log:
        follower = start_follower(model_dir, port, log)
        try:
            llm = LLM(model_dir, tensor_parallel_size=3, nnodes=2, master_port=port, **ENGINE)
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
            llm.llm_engine.shutdown()  # a clean end: rank 0 tells the follower
            assert follower.wait(30) == 0
        finally:
            follower.kill()
