"""The engine core in its own process: same tokens as in-process, utility calls, aborts, and
every way the pair can die (core killed, core faulted, frontend killed, SIGTERM) without a
hang or an orphaned process."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core_client import InprocClient, SyncMPClient
from jaxserve.engine.core_proc import FAULT_ENV, STEP_DELAY_ENV
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.llm import LLM
from jaxserve.ipc.messages import EngineCoreRequest
from jaxserve.sampling_params import SamplingParams
from tests.helpers import drain_engine, make_tiny_hf

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              num_gpu_blocks_override=64, async_scheduling=True)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1 + i, 2, 3 + i, 4]} for i in range(5)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def mp_llm(model_dir):
    llm = LLM(model_dir, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def start_engine(model_dir, **env) -> LLMEngine:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLMEngine.from_engine_args(EngineArgs(model=model_dir, **ENGINE), multiprocess=True)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def wait_dead(proc: subprocess.Popen, within: float) -> int:
    deadline = time.monotonic() + within
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is not None, f"core process {proc.pid} still alive after {within} s"
    return proc.returncode


def test_llm_runs_the_core_in_its_own_process_with_the_same_tokens(mp_llm, model_dir):
    client = mp_llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient) and client.proc.pid != os.getpid()
    ours = [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    inproc = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **ENGINE), multiprocess=False)
    assert isinstance(inproc.engine_core, InprocClient)
    assert gc.get_freeze_count() > 0  # the engines' start-up heap, out of the collector's passes
    for i, prompt in enumerate(PROMPTS):
        inproc.add_request(str(i), prompt, GREEDY)
    done = drain_engine(inproc)
    assert ours == [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]
    assert all(len(t) == 12 for t in ours)


def test_aborts_utilities_and_bad_requests_leave_the_core_serving(mp_llm):
    engine = mp_llm.llm_engine
    for i in range(4):
        engine.add_request(f"a{i}", PROMPTS[i], LONG)
    for _ in range(3):
        engine.step()
    engine.abort_request(["a1", "a3"])
    finished = drain_engine(engine)
    assert set(finished) == {"a0", "a2"}
    assert all(len(o.outputs[0].token_ids) == 100 for o in finished.values())
    state = engine.engine_core.call_utility("get_state")  # also runs check_no_leaks()
    assert state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"] - 1
    # A message the core cannot decode (a frontend's bug: a bool token id past every check)
    # fails its request alone; the core's input thread goes on.
    client = engine.engine_core
    client.add_request(EngineCoreRequest("undecodable", [1, True], GREEDY, None, time.time()))
    outputs = []
    while not outputs:
        outputs = [o for o in client.get_output().outputs if o.request_id == "undecodable"]
    assert outputs[0].finish_reason == "error" and "ValidationError" in outputs[0].stop_reason
    with pytest.raises(RuntimeError, match="no utility 'shutdown'"):
        engine.engine_core.call_utility("shutdown")
    with pytest.raises(OverflowError):  # arguments the wire cannot carry: no waiter left behind
        client.call_utility("collective_rpc", "max_step_tokens", [2**64], {})
    assert client._pending == {}
    with pytest.raises(ValueError, match="token id 999 is out of vocabulary"):
        mp_llm.generate([{"prompt_token_ids": [1, 999]}], GREEDY)
    assert engine.reset_prefix_cache() is True
    assert len(mp_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


def test_sigkilled_core_fails_every_waiter_fast_and_new_calls_at_once(model_dir):
    engine = start_engine(model_dir)
    proc = engine.engine_core.proc
    for i in range(3):
        engine.add_request(f"s{i}", PROMPTS[i], LONG)
    engine.step()
    os.kill(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        while True:
            engine.step()
    assert time.monotonic() - start < 5
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        engine.add_request("late", PROMPTS[0], GREEDY)
    with pytest.raises(EngineDeadError):
        engine.engine_core.call_utility("get_state")
    assert time.monotonic() - start < 0.5
    engine.shutdown()
    assert proc.poll() is not None


def test_a_fault_in_the_model_step_kills_the_core_cleanly(model_dir):
    engine = start_engine(model_dir, **{FAULT_ENV: "3"})
    for i in range(3):
        engine.add_request(f"f{i}", PROMPTS[i], LONG)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="fatal error"):
        while True:
            engine.step()
    assert time.monotonic() - start < 5
    assert wait_dead(engine.engine_core.proc, 5) == 1
    engine.shutdown()


@pytest.mark.parametrize("timeout", ["30", "0.3"])
def test_sigterm_refuses_new_work_finishes_or_aborts_in_flight(model_dir, timeout):
    """After SIGTERM the core answers a new request at once as aborted, lets the running ones
    finish (or aborts them when JAXSERVE_SHUTDOWN_TIMEOUT runs out) and exits 0."""
    engine = start_engine(model_dir, JAXSERVE_SHUTDOWN_TIMEOUT=timeout,
                          **{STEP_DELAY_ENV: "0.02"})  # 100 tokens take over 2 s  # fmt: skip
    proc = engine.engine_core.proc
    for i in range(3):
        engine.add_request(f"t{i}", PROMPTS[i], LONG)
    engine.step()
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not engine.engine_core.call_utility("get_state")["shutting_down"]:
        assert time.monotonic() < deadline, "the core did not see SIGTERM"
        time.sleep(0.01)
    engine.add_request("late", PROMPTS[3], GREEDY)
    finished = drain_engine(engine)
    late = finished["late"].outputs[0]
    assert late.finish_reason == "abort" and late.token_ids == []
    lengths = [len(finished[f"t{i}"].outputs[0].token_ids) for i in range(3)]
    reasons = {finished[f"t{i}"].outputs[0].finish_reason for i in range(3)}
    if timeout == "30":
        assert lengths == [100] * 3 and reasons == {"length"}
    else:
        assert max(lengths) < 100 and reasons == {"abort"}
    assert wait_dead(proc, 10) == 0
    with pytest.raises(EngineDeadError):
        engine.add_request("refused", PROMPTS[3], GREEDY)
    engine.shutdown()


def test_core_exits_when_its_frontend_is_killed(model_dir, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from jaxserve.engine.arg_utils import EngineArgs
        from jaxserve.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_engine_args(EngineArgs(model={model_dir!r}, **{ENGINE!r}),
                                            multiprocess=True)
        print(engine.engine_core.proc.pid, flush=True)
        time.sleep(600)
    """)
    frontend = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    core_pid = int(frontend.stdout.readline())
    os.kill(frontend.pid, signal.SIGKILL)
    frontend.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:  # gone, or a zombie nobody reaps (an orphan in a container without an init)
            with open(f"/proc/{core_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(core_pid, signal.SIGKILL)
    pytest.fail(f"EngineCore {core_pid} outlived its frontend by 5 s")


def test_a_generate_calls_requests_reach_the_core_in_one_message(mp_llm, monkeypatch):
    """One ADD for all of a generate() call's requests: the core admits them together (one
    message each, the core's input thread could take the GIL only once per switch interval
    of its busy loop, and a fast step ran the first few to the end alone)."""
    client = mp_llm.llm_engine.engine_core
    sent = []
    send = client._send
    monkeypatch.setattr(client, "_send", lambda *a: (sent.append(a), send(*a))[1])
    outs = mp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    adds = [payload for _, kind, payload in sent if kind.name == "ADD"]
    assert [len(p) for p in adds] == [len(PROMPTS)]
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
