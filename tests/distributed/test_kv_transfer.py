"""KV connectors (distributed/kv_transfer): a producer engine's KV loaded by a consumer engine
instead of recomputed (files, or straight over ZeroMQ), and the host-memory offloading tier.
In-process engines on a tiny random-weight model; greedy output must equal a plain engine's."""

import inspect
import socket
import time

import numpy as np
import pytest

from jaxserve.config import KV_CONNECTORS, KVTransferConfig
from jaxserve.core import scheduler_utils
from jaxserve.core.kv_connector import SchedulerKVConnector
from jaxserve.distributed.kv_transfer import connector_class, create_connector
from jaxserve.distributed.kv_transfer.base import BlockLayout
from jaxserve.distributed.kv_transfer.zmq_connector import ZmqConnector
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import kv_block_io
from jaxserve.worker.executables import num_compilations
from tests.helpers import core_of, engines_in_process, make_tiny_hf

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
              num_gpu_blocks_override=64)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1)
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(70 + 5 * i)] for i in range(3)]


@pytest.fixture(scope="module", autouse=True)
def in_process():
    """Engines in this process (the tests look inside them), one model load for all."""
    with engines_in_process():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=model_dir, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(as_prompts(PROMPTS), GREEDY)]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def as_prompts(token_lists):
    return [{"prompt_token_ids": p} for p in token_lists]


def core(llm):
    return core_of(llm)


def run(llm, req_id, prompt, params, kv_transfer_params=None):
    """One request through the engine to its end: the finished RequestOutput."""
    engine = llm.llm_engine
    engine.add_request(
        req_id, {"prompt_token_ids": prompt}, params, kv_transfer_params=kv_transfer_params
    )
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def expected_hit(prompt, block_size=16):
    """Every full block but the one holding the last prompt token."""
    return (len(prompt) - 1) // block_size * block_size


# ---------------------------------------------------------------------- block copies
def test_gather_then_scatter_moves_whole_blocks():
    import jax.numpy as jnp

    layers, n_blocks = 3, 5
    k = jnp.arange(layers * n_blocks * 2 * 1 * 2, dtype=jnp.float32).reshape(-1, 2, 1, 2)
    kv = (k, -k)
    ids = jnp.array([[3], [1]])
    blocks = np.asarray(kv_block_io.gather_blocks(kv, ids, num_slots=layers))
    assert blocks.shape == (2, layers, 2, 1, 4)  # [n, L, bs, H, K's 2 then V's 2]
    for i, b in enumerate([3, 1]):
        for layer in range(layers):
            np.testing.assert_array_equal(blocks[i, layer, ..., :2], k[layer * n_blocks + b])
            np.testing.assert_array_equal(blocks[i, layer, ..., 2:], -k[layer * n_blocks + b])
    to = jnp.array([[4], [2]])
    moved = kv_block_io.scatter_blocks(kv, to, jnp.asarray(blocks), num_slots=3)
    for layer in range(layers):
        np.testing.assert_array_equal(moved[0][layer * n_blocks + 4], k[layer * n_blocks + 3])
        np.testing.assert_array_equal(moved[1][layer * n_blocks + 2], -k[layer * n_blocks + 1])
        np.testing.assert_array_equal(moved[0][layer * n_blocks], k[layer * n_blocks])
    assert kv_block_io.copy_buckets(5) == [1, 2, 4, 8]
    assert kv_block_io.copy_buckets(1000)[-1] == kv_block_io.MAX_BLOCKS_PER_COPY
    (ids, start, n), *rest = kv_block_io.chunks([7, 8, 9], [1, 2, 4])
    assert ids[:, 0].tolist() == [7, 8, 9, 0] and (start, n) == (0, 3) and not rest


def test_a_block_position_moves_with_its_block_of_every_group():
    """KV-cache groups (config/kv_groups.py): position i's blocks, one per group, gather into
    [G * S] layers (group 0's S slots, then group 1's) and scatter back to other ids."""
    import jax.numpy as jnp

    slots, n_blocks = 2, 6
    k = jnp.arange(slots * n_blocks * 3, dtype=jnp.float32).reshape(-1, 1, 1, 3)
    ids = jnp.array([[1, 4], [2, 0]])  # position 0: group 0's block 1, group 1's block 4
    blocks = np.asarray(kv_block_io.gather_blocks((k,), ids, num_slots=slots))
    assert blocks.shape == (2, 2 * slots, 1, 1, 3)
    for i in range(2):
        for g in range(2):
            for s in range(slots):
                want = k[s * n_blocks + int(ids[i, g])]
                np.testing.assert_array_equal(blocks[i, g * slots + s], want)
    to = jnp.array([[3, 5]])
    (moved,) = kv_block_io.scatter_blocks((k,), to, jnp.asarray(blocks[:1]), num_slots=slots)
    for s in range(slots):
        np.testing.assert_array_equal(moved[s * n_blocks + 3], k[s * n_blocks + 1])
        np.testing.assert_array_equal(moved[s * n_blocks + 5], k[s * n_blocks + 4])
    (ids, _, n), *_ = kv_block_io.chunks([(1, 4), (2, 0), (7, 7)], [1, 2, 4], num_groups=2)
    assert ids.tolist() == [[1, 4], [2, 0], [7, 7], [0, 0]] and n == 3


# ---------------------------------------------------------------------- the scheduler's view
def test_every_connector_has_the_calls_the_scheduler_makes():
    """core/ knows a connector only as core/kv_connector.py's protocol: every connector has
    its calls, with the same parameters."""
    calls = [
        n for n, f in vars(SchedulerKVConnector).items() if inspect.isfunction(f) and n[0] != "_"
    ]
    assert "build_connector_meta" in calls and len(calls) == 7
    for name in KV_CONNECTORS:
        cls = connector_class(name)
        for call in calls:
            want = inspect.signature(getattr(SchedulerKVConnector, call)).parameters
            assert list(inspect.signature(getattr(cls, call)).parameters) == list(want), call
    config = KVTransferConfig(
        "OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20}
    )
    layout = BlockLayout((1, 4, 1, 16), np.dtype(np.float32), "tiny")
    assert isinstance(create_connector(config, layout), SchedulerKVConnector)


# ---------------------------------------------------------------------- ExampleConnector
def test_example_connector_consumer_loads_what_the_producer_saved(model_dir, reference, tmp_path):
    store = tmp_path / "kv"
    config = {"kv_connector": "SharedStorageConnector",  # vLLM's old name is accepted
              "kv_connector_extra_config": {"shared_storage_path": str(store)}}  # fmt: skip
    producer = LLM(
        model=model_dir, **ENGINE, kv_transfer_config={**config, "kv_role": "kv_producer"}
    )
    producer.generate(as_prompts(PROMPTS), PREFILL)
    files = list(store.rglob("*.kv"))
    assert len(files) == sum(len(p) // 16 for p in PROMPTS)  # every full prompt block

    consumer = LLM(
        model=model_dir, **ENGINE, kv_transfer_config={**config, "kv_role": "kv_consumer"}
    )
    outs = consumer.generate(as_prompts(PROMPTS), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [expected_hit(p) for p in PROMPTS]
    stats = core(consumer).scheduler.connector.totals()
    assert stats.loaded_blocks == sum(expected_hit(p) // 16 for p in PROMPTS)
    assert core(consumer).get_state()["num_free_blocks"] == ENGINE["num_gpu_blocks_override"] - 1

    # The loaded blocks are what the consumer computes with: zeroed files change the output.
    for f in files:
        f.write_bytes(bytes(f.stat().st_size))
    fresh = LLM(model=model_dir, **ENGINE, kv_transfer_config={**config, "kv_role": "kv_consumer"})
    start = num_compilations()
    zeroed = fresh.generate(as_prompts(PROMPTS), GREEDY)
    assert num_compilations() == start  # loads and saves run precompiled copies
    assert [o.outputs[0].token_ids for o in zeroed] != reference


# ---------------------------------------------------------------------- ZmqConnector
@pytest.fixture(scope="module")
def zmq_pair(model_dir):
    (port,) = free_ports(1)
    config = {"kv_connector": "ZmqConnector", "kv_port": port,
              "kv_connector_extra_config": {"timeout_s": 1.0}}  # fmt: skip
    producer = LLM(
        model=model_dir, **ENGINE, kv_transfer_config={**config, "kv_role": "kv_producer"}
    )
    consumer = LLM(
        model=model_dir, **ENGINE, kv_transfer_config={**config, "kv_role": "kv_consumer"}
    )
    return producer, consumer, port


def test_zmq_connector_moves_the_prompt_kv_between_engines(zmq_pair, reference):
    producer, consumer, port = zmq_pair
    for i, prompt in enumerate(PROMPTS):
        first = run(producer, f"p{i}", prompt, PREFILL, {"do_remote_decode": True})
        params = first.kv_transfer_params
        assert params["do_remote_prefill"] and params["remote_port"] == port
        out = run(consumer, f"d{i}", prompt, GREEDY, params)
        assert out.outputs[0].token_ids == reference[i]
        assert out.num_cached_tokens == expected_hit(prompt)  # one block computed at most
    stats = core(consumer).scheduler.connector.totals()
    assert stats.hits == sum(expected_hit(p) for p in PROMPTS) and stats.failed_loads == 0
    # Without kv_transfer_params a consumer computes as any engine does.
    plain = run(consumer, "plain", [5, 6, 7] * 20, GREEDY)
    assert plain.kv_transfer_params is None
    for llm in (producer, consumer):
        state = core(llm).get_state()
        assert state["num_requests"] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_zmq_connector_sends_blocks_of_types_without_a_buffer_format(dtype):
    """bfloat16 and fp8 KV (ml_dtypes types, which memoryview refuses) cross the wire bit for
    bit: the GPU suite's bf16 KV once failed here while the CPU tests' float32 passed."""
    import ml_dtypes

    layout = BlockLayout((1, 4, 1, 16), np.dtype(getattr(ml_dtypes, dtype)), "tiny")
    (port,) = free_ports(1)
    base = {"kv_connector": "ZmqConnector", "kv_port": port}
    producer = ZmqConnector(KVTransferConfig(**base, kv_role="kv_producer"), layout)
    consumer = ZmqConnector(KVTransferConfig(**base, kv_role="kv_consumer"), layout)
    try:
        rng = np.random.default_rng(0)
        blocks = rng.standard_normal((3, *layout.shape), np.float32).astype(layout.dtype)
        hashes = [rng.bytes(32) for _ in range(3)]
        producer.write(hashes, blocks)
        consumer._fetching["r"] = [7, 8, 9]
        consumer._fetch("r", f"tcp://127.0.0.1:{port}", hashes)
        assert consumer.get_finished_recving() == {"r": 3 * layout.block_size}
        got = np.stack([block for _, block in consumer._loads["r"]])
        assert got.dtype == layout.dtype
        np.testing.assert_array_equal(got.view(np.uint8), blocks.view(np.uint8))
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_request_failing_in_the_scheduler_fails_alone(zmq_pair, reference, monkeypatch):
    """On the consumer engine: the issue's kv_transfer_params are a ValueError before the
    engine; requests whose connector calls or stop check raise (injected) finish with "error"
    while the others beside them give the reference output; no block leaks; it goes on."""
    _, consumer, _ = zmq_pair
    engine, sched = consumer.llm_engine, core(consumer).scheduler
    issue = {"do_remote_prefill": True, "remote_host": "x", "remote_port": "abc"}
    with pytest.raises(ValueError, match="remote_port"):
        engine.add_request("issue", {"prompt_token_ids": PROMPTS[0]}, GREEDY,
                           kv_transfer_params=issue)  # fmt: skip
    (dead_port,) = free_ports(1)
    remote = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": dead_port}

    def failing(obj, name, bad_id):
        call = getattr(obj, name)

        def wrapper(request, *args):
            result = call(request, *args)  # its own bookkeeping first: then it raises
            if request.request_id == bad_id and (
                name != "check_stop" or len(request.output_token_ids) == 3
            ):
                raise RuntimeError(f"injected in {name}")
            return result

        monkeypatch.setattr(obj, name, wrapper)

    calls = {"bad-match": (sched.connector, "get_num_new_matched_tokens"),
             "bad-alloc": (sched.connector, "update_state_after_alloc"),
             "bad-finished": (sched.connector, "request_finished"),
             "bad-update": (scheduler_utils, "check_stop")}  # fmt: skip
    for bad_id, (obj, name) in calls.items():
        failing(obj, name, bad_id)
    # the failing requests first, so the healthy ones run beside them (max_num_seqs 4)
    for bad_id in calls:  # only bad-alloc's KV comes from another instance
        params = remote if bad_id == "bad-alloc" else None
        prompt = {"prompt_token_ids": [p + 3 for p in PROMPTS[1]]}
        engine.add_request(bad_id, prompt, GREEDY, kv_transfer_params=params)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ok{i}", {"prompt_token_ids": prompt}, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    for bad_id, (_, name) in calls.items():
        out = finished.pop(bad_id)
        assert (out.finish_reason, out.stop_reason) == (
            "error",
            f"RuntimeError: injected in {name}",
        )
    assert [finished[f"ok{i}"].token_ids for i in range(len(PROMPTS))] == reference
    state = core(consumer).get_state()  # runs check_no_leaks()
    assert state["num_requests"] == 0
    assert state["num_free_blocks"] == ENGINE["num_gpu_blocks_override"] - 1
    monkeypatch.undo()
    assert run(consumer, "after", PROMPTS[2], GREEDY).outputs[0].token_ids == reference[2]


def test_a_consumer_recomputes_when_the_producer_does_not_answer(model_dir, zmq_pair, reference):
    _, consumer, _ = zmq_pair
    (dead_port,) = free_ports(1)  # nothing listens there
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": dead_port}
    prompt = [p + 1 for p in PROMPTS[0]]  # not in the consumer's device cache
    expected = run(LLM(model=model_dir, **ENGINE), "ref", prompt, GREEDY)
    start = time.monotonic()
    out = run(consumer, "orphan", prompt, GREEDY, params)
    assert time.monotonic() - start < 10  # the 1 s timeout, then the prompt's compute
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.num_cached_tokens == 0
    assert core(consumer).scheduler.connector.totals().failed_loads >= 1
    core(consumer).get_state()  # no leaked blocks


def test_an_aborted_request_waiting_for_remote_kv_frees_its_blocks(zmq_pair):
    _, consumer, _ = zmq_pair
    (dead_port,) = free_ports(1)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": dead_port}
    engine = consumer.llm_engine
    prompt = {"prompt_token_ids": [p + 2 for p in PROMPTS[2]]}  # not on the device
    engine.add_request("waits", prompt, GREEDY, kv_transfer_params=params)
    engine.step()
    sched = core(consumer).scheduler
    assert "waits" in sched.waiting_for_remote  # off the waiting queue, holding its blocks
    assert sched.kv_cache_manager.num_free_blocks < ENGINE["num_gpu_blocks_override"] - 1
    engine.abort_request(["waits"])
    assert not sched.waiting_for_remote and not engine.has_unfinished_requests()
    assert core(consumer).get_state()["num_free_blocks"] == ENGINE["num_gpu_blocks_override"] - 1
    time.sleep(1.5)  # the fetch times out after the abort: nothing to deliver it to
    assert sched.connector.get_finished_recving() == {}


def test_load_failure_policy_fail_ends_the_request(model_dir):
    (port, dead_port) = free_ports(2)
    llm = LLM(model=model_dir, **ENGINE, kv_transfer_config={
        "kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_port": port,
        "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"timeout_s": 0.5},
    })  # fmt: skip
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": dead_port}
    out = run(llm, "r", PROMPTS[0], GREEDY, params)
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert core(llm).get_state()["num_free_blocks"] == ENGINE["num_gpu_blocks_override"] - 1


# ---------------------------------------------------------------------- offloading
def test_offloaded_blocks_come_back_after_device_eviction(model_dir):
    # 24 device blocks of 16 tokens: the long prompt's 12 blocks are evicted by the others.
    small = {**ENGINE, "num_gpu_blocks_override": 24}
    long_prompt = [(11 * j) % 190 + 5 for j in range(200)]
    others = [[(13 * j + i) % 180 + 9 for j in range(150)] for i in range(3)]
    plain = LLM(model=model_dir, **small)
    offload = LLM(model=model_dir, **small, kv_offloading_size=0.01)
    results = {}
    for name, llm in (("plain", plain), ("offload", offload)):
        outs = [run(llm, f"{name}{i}", p, GREEDY) for i, p in enumerate([long_prompt, *others])]
        again = run(llm, f"{name}-again", long_prompt, GREEDY)
        results[name] = ([o.outputs[0].token_ids for o in outs], again)
        state = core(llm).get_state()
        assert state["num_requests"] == 0 and state["num_free_blocks"] == 23
    (plain_outs, plain_again), (off_outs, off_again) = results["plain"], results["offload"]
    assert off_outs == plain_outs
    assert off_again.outputs[0].token_ids == plain_again.outputs[0].token_ids
    assert plain_again.num_cached_tokens == 0  # evicted from the device: recomputed
    assert off_again.num_cached_tokens == expected_hit(long_prompt)  # from the host tier
    stats = core(offload).scheduler.connector.totals()
    assert stats.hits == expected_hit(long_prompt) and stats.loaded_blocks == 12


# ---------------------------------------------------------------------- configuration
ZMQ, EXAMPLE = {"kv_connector": "ZmqConnector"}, {"kv_connector": "ExampleConnector"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_transfer_config": {"kv_connector": "NixlConnector"}}, "'NixlConnector' is not"),
        ({"kv_transfer_config": {**EXAMPLE, "kv_role": "both"}}, "kv_role 'both'"),
        ({"kv_transfer_config": '{"kv_connector": '}, "kv_transfer_config .* is not JSON"),
        ({"kv_transfer_config": {**ZMQ, "kv_load_failure_policy": "retry"}}, "'retry'"),
        ({"kv_transfer_config": {**ZMQ, "bogus": 1}}, "unknown fields ['bogus']"),
        ({"kv_offloading_size": -1}, "kv_offloading_size must be a positive"),
        ({"kv_offloading_size": 1, "kv_transfer_config": ZMQ}, "one KV connector"),
    ],
)  # fmt: skip
def test_bad_kv_transfer_settings_are_named(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineArgs(model=model_dir, **kwargs).create_engine_config()


def test_example_connector_needs_its_storage_path(model_dir):
    with pytest.raises(ValueError, match="shared_storage_path"):
        LLM(model=model_dir, **ENGINE, kv_transfer_config={"kv_connector": "ExampleConnector"})


def test_the_connector_stays_out_of_the_step_signature(model_dir):
    config = EngineArgs(
        model=model_dir, kv_transfer_config={"kv_connector": "ZmqConnector"}
    ).create_engine_config()
    assert config.kv_transfer.kv_role == "kv_both" and "kv_transfer" not in repr(config)


def test_offload_soak_leaks_no_blocks(model_dir):
    """Concurrent requests sharing prefixes on a device cache small enough to preempt, with
    the host tier on: every device block comes back, the host tier stays in its size."""
    small = {**ENGINE, "num_gpu_blocks_override": 20, "async_scheduling": True}
    llm = LLM(model=model_dir, **small, kv_offloading_size=0.002)  # 2 MiB: ~340 tiny blocks
    rng = np.random.default_rng(1)
    heads = [rng.integers(3, 200, 48).tolist() for _ in range(4)]
    prompts = [heads[i % 4] + rng.integers(3, 200, int(rng.integers(1, 40))).tolist()
               for i in range(40)]  # fmt: skip
    plain = LLM(model=model_dir, **small)
    want = [o.outputs[0].token_ids for o in plain.generate(as_prompts(prompts), GREEDY)]
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(as_prompts(prompts), GREEDY)]
        assert got == want
    connector = core(llm).scheduler.connector
    assert connector.totals().hits > 0 and core(llm).scheduler.total_preemptions > 0
    assert len(connector.store) <= connector.store.capacity_blocks
    state = core(llm).get_state()  # check_no_leaks() too
    assert state["num_requests"] == 0 and state["num_free_blocks"] == 19
