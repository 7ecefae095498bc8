"""Saved step executables: a second start with the same signature loads them (no compile, the
same tokens); a change to anything the signature covers is another file; a bad file is ignored
and compiled over."""

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import pytest

from jaxserve import cache_keys
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import executable_cache
from jaxserve.worker.buckets import bucket
from jaxserve.worker.executables import (
    BACKGROUND_THREADS,
    ExecutableRegistry,
    num_compilations,
)
from tests.helpers import engine_with_registry, generate_ids, make_tiny_hf, runner_of

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8,
              num_gpu_blocks_override=16)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("compile-cache")
        mp.setenv("JAXSERVE_COMPILE_CACHE", str(path))
        mp.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
        yield path


@pytest.fixture(scope="module")
def first(model_dir, cache_dir):
    """The first start: compiles every step shape and saves them."""
    return start(model_dir)


PROMPTS = ([5, 9, 11, 3], [7, 7, 2, 30, 31, 4, 18, 2, 6])


def generate(llm: LLM | LLMEngine, params: SamplingParams) -> list[list[int]]:
    if isinstance(llm, LLMEngine):
        return generate_ids(llm, list(PROMPTS), params)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def start(model_dir, **overrides) -> tuple[LLM, int]:
    """An engine in this process, and the compilations its start-up asked XLA for."""
    before = num_compilations()
    llm = LLM(str(model_dir), **{**ENGINE, **overrides})
    return llm, num_compilations() - before


def runner(llm: LLM):
    return runner_of(llm)


def test_a_second_start_loads_every_executable_and_gives_the_same_tokens(
    model_dir, cache_dir, first, caplog
):
    first, compiled = first
    steps = len(runner(first).executables.names())
    assert compiled >= steps > 0  # + a few small start-up jits (KV cache, penalty state)
    assert len(list((cache_dir / "executables").glob("*.pkl"))) == 1
    with caplog.at_level(logging.INFO, "jaxserve.worker.executables"):
        second, compiled_again = start(model_dir)
    assert f"loaded {steps} step shapes" in caplog.text
    assert compiled_again <= compiled - steps  # no step executable compiled
    assert set(runner(second).executables.names()) == set(runner(first).executables.names())
    serving = num_compilations()
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12, logprobs=2)
    for params in (SamplingParams(temperature=0, max_tokens=12), sampled):
        assert generate(second, params) == generate(first, params)
    assert num_compilations() == serving  # serving from loaded executables compiles nothing


def test_a_different_flag_model_file_jax_or_source_is_a_different_signature(
    model_dir, first, monkeypatch
):
    runner_ = runner(first[0])
    config = runner_.engine_config
    key = runner_.executables_key()
    assert runner_.executables_key() == key  # deterministic
    runner_.engine_config = dataclasses.replace(
        runner_.engine_config, max_logprobs=runner_.engine_config.max_logprobs + 1
    )
    assert runner_.executables_key() != key
    runner_.engine_config = config
    weights = next(model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # rewritten in place
    try:
        assert runner_.executables_key() != key
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert runner_.executables_key() == key
    with monkeypatch.context() as m:
        m.setattr(jax, "__version__", "0.0.1")
        assert runner_.executables_key() != key
    with monkeypatch.context() as m:
        m.setattr(cache_keys, "source_digest", lambda: "edited")
        assert runner_.executables_key() != key
    with monkeypatch.context() as m:
        m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
        assert runner_.executables_key() != key


def test_an_unreadable_file_is_ignored_and_compiled_over(model_dir, cache_dir, first, caplog):
    llm = first[0]
    (path,) = (cache_dir / "executables").glob("*.pkl")
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.INFO):
        again, _ = start(model_dir)
    assert f"compiled {len(runner(again).executables.names())} step shapes" in caplog.text
    assert "ignoring the saved executables" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=8)
    assert generate(again, params) == generate(llm, params)
    assert path.stat().st_size > 1000  # written again


RUN = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)  # the engine core runs in this process: its log here
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
# Two engines whose executables differ only in their saved file's key: jax's in-memory caches
# hand the second some of the first one's executables.
engines = [LLM(sys.argv[1], **json.loads(sys.argv[2]), async_scheduling=bool(i)) for i in range(2)]
prompts = [{"prompt_token_ids": [5, 9, 11, 3]}, {"prompt_token_ids": [7, 7, 2, 30, 31, 4]}]
for params in (SamplingParams(temperature=0, max_tokens=10),
               SamplingParams(temperature=0.9, seed=1, max_tokens=10, logprobs=1,
                              presence_penalty=0.5)):
    print([o.outputs[0].token_ids for o in engines[-1].generate(prompts, params, use_tqdm=False)])
"""


def test_executables_saved_from_persistent_cache_hits_run_in_a_new_process(model_dir, tmp_path):
    """jax's persistent cache hits are saved as the bytes it read (re-serializing a deserialized
    XLA:CPU executable loses its kernels: "Function ... not found" in the next process), also
    where a second engine in the process is handed the first one's hit by jax's in-memory
    caches (it is left out of the file, not re-serialized)."""

    def run() -> tuple[str, str]:
        env = {**os.environ, "JAXSERVE_COMPILE_CACHE": str(tmp_path),
               "JAXSERVE_ENABLE_MULTIPROCESSING": "0"}  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", RUN, str(model_dir), json.dumps(ENGINE)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout, done.stderr

    cold, log = run()  # compiles (and fills jax's persistent cache)
    assert re.search(r"compiled \d+ step shapes", log), log
    shutil.rmtree(tmp_path / "executables")
    hits, log = run()  # every step shape a persistent-cache hit; saved from those bytes
    assert re.search(r"compiled \d+ step shapes", log) and hits == cold
    assert "could not save" not in log, log
    loaded, log = run()
    assert re.search(r"loaded \d+ step shapes", log) and loaded == cold, log


def test_only_the_most_recently_used_files_are_kept(tmp_path):
    for i in range(5):
        path = tmp_path / f"{i}.pkl"
        path.write_bytes(b"x")
        os.utime(path, ns=(i * 10**9, i * 10**9))
    executable_cache.prune(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.glob("*.pkl")) == ["2.pkl", "3.pkl", "4.pkl"]


def test_background_compile_serves_at_once_without_compiling_then_saves_all(
    model_dir, cache_dir, first, monkeypatch
):
    """background_compile: the engine is ready with the steps of token buckets 1, 4, 16, ..
    and max_num_seqs' and the greedy and all-pass samplers; until the rest is in, a step pads to
    the next ready bucket and takes at most max_num_seqs' tokens, sampling takes the all-pass
    variant, and nothing compiles on the serving path. The same tokens as a start that
    compiled everything. What is compiled is saved at once (a stopped start keeps it), every
    shape once all are in, and a second start loads them."""
    monkeypatch.setenv("JAXSERVE_MINIMAL_COMPILE", "0")  # every shape, as a server compiles
    gate = threading.Event()

    def gated(name, lowered):  # the background thread compiles nothing until the gate opens
        if threading.current_thread().name.startswith(BACKGROUND_THREADS):
            assert gate.wait(120)
        return lowered.compile()

    config = dict(max_num_seqs=8, max_num_batched_tokens=16, background_compile=True)
    before = num_compilations()
    engine = engine_with_registry(model_dir, ExecutableRegistry(gated), **{**ENGINE, **config})
    assert num_compilations() > before
    r = engine.engine_core.engine_core.runner
    all_shapes = set(r.lowerings())
    # token buckets 1, 4 and max_num_seqs' 8 are in: a 2-token step pads to 4, 16 waits
    assert r.executables.compiling and r.max_step_tokens() == 8
    assert bucket(r.ready_token_buckets(), 2) == 4
    later = {("forward", 2, False), ("forward", 16, False), ("prompt_logprobs", 2)}
    assert later.isdisjoint(r.executables.names()) and later < all_shapes
    steps = []
    dispatch = r.dispatch
    monkeypatch.setattr(
        r, "dispatch", lambda so: steps.append(so.total_num_scheduled_tokens) or dispatch(so)
    )
    serving = num_compilations()
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12, logprobs=2)
    for params in (SamplingParams(temperature=0, max_tokens=12), sampled):
        assert generate(engine, params) == generate(first[0], params)
    assert num_compilations() == serving and max(steps) == 8  # a 9-token prompt: 8 + 1

    for _ in range(600):  # what a start stopped now would keep: the shapes it has compiled
        partial = executable_cache.read(str(cache_dir), r.executables_key())
        if partial:
            break
        time.sleep(0.1)
    assert partial is not None and set(partial) == r.executables.names() != all_shapes

    gate.set()
    assert r.wait_compiled(300) and r.executables.names() == all_shapes
    assert r.max_step_tokens() == 16 and bucket(r.ready_token_buckets(), 2) == 2
    steps.clear()
    assert generate(engine, SamplingParams(temperature=0, max_tokens=4)) == [
        t[:4] for t in generate(first[0], SamplingParams(temperature=0, max_tokens=4))
    ]
    assert max(steps) > 8
    saved = executable_cache.read(str(cache_dir), r.executables_key())
    assert saved is not None and set(saved) == all_shapes

    again, compiled = start(model_dir, **config)
    assert runner(again).wait_compiled(300) and set(runner(again).executables.names()) == all_shapes
    assert compiled < len(all_shapes)  # loaded, not compiled
    assert generate(again, sampled) == generate(first[0], sampled)


def test_the_collector_stays_off_until_the_last_loading_thread_is_done():
    """Two start-ups loading at once (an engine's background compile beside the next one's
    load): the first to finish must not turn the collector back on under the second."""
    import gc

    inside, release = threading.Event(), threading.Event()

    def second() -> None:
        with executable_cache.no_gc():
            inside.set()
            release.wait(10)

    assert gc.isenabled()
    with executable_cache.no_gc():
        thread = threading.Thread(target=second)
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the second thread is still loading
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_persistent_cache_entries_appear_whole(tmp_path, monkeypatch):
    """jax's persistent cache (no size limit: no lock) gets each entry written beside it and
    renamed over it, so a process sharing the cache never reads half an executable."""
    from jax._src import lru_cache

    executable_cache.watch_cache_reads()
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    target = tmp_path / f"key{lru_cache._CACHE_SUFFIX}"
    renames, real_replace = [], os.replace

    def replace(src, dst):
        renames.append((Path(src).read_bytes(), Path(dst) == target, target.exists()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    cache.put("key", b"x" * 4096)
    cache.put("key", b"y")  # an entry is written once
    assert renames == [(b"x" * 4096, True, False)]
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    assert cache.get("key") == b"x" * 4096
    assert target.stat().st_mode & 0o777 == 0o644  # readable by a cache shared between users
