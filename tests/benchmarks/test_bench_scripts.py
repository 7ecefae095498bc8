"""The benchmark scripts run end to end on a tiny model for a few iterations: their printed
lines and JSON (vLLM's formats), not their speed.

bench_latency and bench_throughput run in this process (engine core in-process) on a tiny
config with `--load-format dummy`, and on a tiny HF checkpoint for the hf backend;
bench_serve drives a real `jaxserve serve` subprocess; bench_startup launches its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from jaxserve import envs
from jaxserve.benchmarks.common import decode_step_seconds
from tests.entrypoints.openai.test_api_server import Server
from tests.helpers import TINY, make_tiny_hf
from tests.require import require_or_skip

ROOT = Path(__file__).parents[2]
# Fits the server tests' flags (max_model_len 512); no tokenizer files: token ids only.
TINY_CONFIG = {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "rms_norm_eps": 1e-5, "eos_token_id": 2,
               "max_position_embeddings": 1024}  # fmt: skip
ENGINE = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
          "--num-gpu-blocks-override", "64"]  # fmt: skip
NUM = r"[-+0-9.e]+"
ROOFLINE = re.compile(
    rf"^Roofline: step {NUM} ms, memory bound {NUM} ms \({NUM} of it\), "
    rf"compute bound {NUM} ms \({NUM} of it\)$",
    re.M,
)


def script(path: str):
    """The script's main(argv), without running it as __main__."""
    return runpy.run_path(str(ROOT / path), run_name="bench")["main"]


def suite_report():
    """scripts/gpu_suite_report.py, the GPU suite's report, as a module."""
    path = ROOT / "scripts" / "gpu_suite_report.py"
    spec = importlib.util.spec_from_file_location("gpu_suite_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dummy")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))


@pytest.fixture
def inproc(monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("latency", ["--batch-size", "--num-iters-warmup", "--num-iters", "--input-len",
                     "--output-len", "--output-json", "--model", "--max-model-len"]),
        ("throughput", ["--num-prompts", "--input-len", "--output-len", "--output-json"]),
        ("serve", ["--request-rate", "--num-prompts", "--random-input-len",
                   "--random-output-len", "--max-concurrency", "--save-result"]),
    ],
)  # fmt: skip
def test_jaxserve_bench_help_shows_vllms_flags(name, flags, capsys):
    from jaxserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: jaxserve bench {name}")
    for flag in flags:
        assert f"{flag} " in out or f"{flag}\n" in out, flag


def test_decode_step_is_the_latency_beyond_one_token():
    assert decode_step_seconds(1.3, 0.1, 13) == pytest.approx(0.1)
    assert decode_step_seconds(1.3, 0.1, 1) is None


@pytest.mark.parametrize("backend", ["jaxserve", "hf"])
def test_bench_latency(backend, dummy_dir, hf_dir, tmp_path, capsys, inproc):
    model = ["--model", str(dummy_dir), "--load-format", "dummy"] if backend == "jaxserve" else [
        "--model", str(hf_dir)]  # fmt: skip
    out_json = tmp_path / "latency.json"
    results = script("scripts/bench_latency.py")(
        ["--backend", backend, *model, *ENGINE, "--batch-size", "2", "--input-len", "8",
         "--output-len", "6", "--num-iters-warmup", "1", "--num-iters", "3", "--repeats", "2",
         "--output-json", str(out_json)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(rf"^Avg latency: {NUM} seconds$", out, re.M)
    for p in (10, 25, 50, 75, 90, 99):
        assert re.search(rf"^{p}% percentile latency: {NUM} seconds$", out, re.M), p
    m = re.search(rf"^Decode step: ({NUM}) ms \(median of 2 runs: ({NUM}), ({NUM}) ms; each "
                  rf"\(avg latency - avg at one output token\) / 5\); {NUM} tokens/s$", out,
                  re.M)  # fmt: skip
    assert m, out
    assert ROOFLINE.search(out)
    saved = json.loads(out_json.read_text())
    assert len(saved["latencies"]) == 2 * 3 and saved["backend"] == backend  # two repeats
    assert set(saved["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert saved["avg_latency"] == pytest.approx(sum(saved["latencies"]) / 6)
    runs = saved["decode_step_runs_ms"]
    assert [f"{r:.2f}" for r in runs] == [m[2], m[3]]
    assert saved["decode_step_ms"] == pytest.approx(sum(runs) / 2)  # the median of two
    # each run's step: its three latencies beyond its three one-token latencies
    first = sum(saved["latencies"][:3]) / 3 - saved["prefill_latency_runs"][0]
    assert runs[0] == pytest.approx(1e3 * first / 5)
    assert saved["roofline"]["weight_bytes"] == results["roofline"]["weight_bytes"] > 0
    # the GPU suite's report reads these lines (its dry run in test_gpu_suite.py runs no
    # latency step): the median and its runs, the roofline against a copy rate too
    row = suite_report().latency_figures(out, 10.0)
    assert f"decode step {m[1]} ms (median of 2: {m[2]}, {m[3]} ms)" in row, row
    assert re.search(rf"\*\*{NUM}%\*\* of the bound at the copy rate, {NUM} ms", row), row


@pytest.mark.parametrize("backend", ["jaxserve", "hf"])
def test_bench_throughput(backend, dummy_dir, hf_dir, tmp_path, capsys, inproc):
    model = ["--model", str(dummy_dir), "--load-format", "dummy"] if backend == "jaxserve" else [
        "--model", str(hf_dir)]  # fmt: skip
    out_json = tmp_path / "throughput.json"
    script("benchmarks/bench_throughput.py")(
        ["--backend", backend, *model, *ENGINE, "--num-prompts", "3", "--input-len", "8",
         "--output-len", "5", "--quiet", "--repeats", "3", "--output-json", str(out_json)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(
        rf"^Throughput: {NUM} requests/s, {NUM} total tokens/s, {NUM} output tokens/s$", out, re.M
    )
    assert re.search(rf"^Runs: {NUM}, {NUM}, {NUM} s \(median of 3\)$", out, re.M)
    assert re.search(rf"^Decode step: {NUM} ms \(median of 3 runs: ", out, re.M)
    assert ROOFLINE.search(out)
    saved = json.loads(out_json.read_text())
    assert saved["num_requests"] == 3 and saved["total_num_tokens"] == 3 * (8 + 5)
    assert saved["elapsed_time"] == sorted(saved["run_times"])[1]  # the median of three
    assert saved["output_tokens_per_second"] == pytest.approx(15 / saved["elapsed_time"])
    assert len(saved["decode_step_runs_ms"]) == 3


def test_bench_serve_summary_counts_failures_and_tpot():
    from jaxserve.benchmarks.serve import RequestResult, summarize

    ok = RequestResult(4, 3, True, "", latency=1.0, ttft=0.2, itl=[0.3, 0.5])
    failed = RequestResult(7, error="HTTP 400")
    m = summarize([ok, failed], duration=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"]) == (1, 1, 4)
    assert m["mean_tpot_ms"] == pytest.approx(400.0)  # (1.0 - 0.2) / (3 - 1)
    assert m["median_itl_ms"] == pytest.approx(400.0) and m["mean_ttft_ms"] == pytest.approx(200)
    assert m["request_throughput"] == 0.5 and m["errors"] == ["", "HTTP 400"]


def test_bench_serve_against_a_server(dummy_dir, tmp_path, capsys):
    # Later flags win over Server's own: two step shapes to compile, not eight.
    server = Server("--load-format", "dummy", str(dummy_dir), *ENGINE)
    try:
        bench = script("benchmarks/bench_serve.py")
        common = ["--base-url", server.url, "--num-prompts", "6", "--random-input-len", "16",
                  "--random-output-len", "8", "--random-range-ratio", "0.5", "--ignore-eos",
                  "--random-vocab-size", "200", "--disable-tqdm"]  # fmt: skip
        result = bench([*common, "--request-rate", "20", "--save-result", "--result-dir",
                        str(tmp_path), "--result-filename", "serve.json"])  # fmt: skip
        capped = bench([*common, "--max-concurrency", "2"])  # all at once, 2 in flight
    finally:
        server.stop()
    out = capsys.readouterr().out
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
                  *(f"{s} {m} (ms):" for m in ("TTFT", "TPOT", "ITL")
                    for s in ("Mean", "Median", "P99"))):  # fmt: skip
        assert re.search(rf"^{re.escape(label)}\s+{NUM}\s*$", out, re.M), label
    assert len(re.findall(r"^Failed requests:\s+0\s*$", out, re.M)) == 2
    assert re.findall(r"^KV cache usage after the run \(%\):\s+(\S+)", out, re.M) == ["0.0"] * 2
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0 and saved["model_id"] == "smol"
    assert saved["total_output_tokens"] == sum(saved["output_lens"]) and 4 <= min(
        saved["output_lens"]) <= max(saved["output_lens"]) <= 12  # fmt: skip
    assert saved["server_after_run"]["kv_cache_usage_perc"] == 0.0
    assert result["request_rate"] == 20 and capped["max_concurrency"] == 2
    assert capped["completed"] == 6


def test_bench_startup(dummy_dir, capsys):
    """Cold (every step shape compiled) and warm (loaded) start-ups. The cold one's config
    cache starts as a copy of this process's, which holds the model's config: a fresh one costs
    the engine core ~5 s of importing transformers and torch to resolve config.json, a part of
    the cold start that nothing here checks (the compile caches still start empty)."""
    from jaxserve.transformers_utils.config import read_hf_config

    read_hf_config(dummy_dir)  # cached (test_bench_latency's engine read it too)
    main = script("benchmarks/bench_startup.py")
    time_startup = main.__globals__["time_startup"]

    def with_the_config_cache(serve_args, cache_dir, timeout):
        ours, its = envs.JAXSERVE_CONFIG_CACHE, Path(cache_dir) / "configs"
        if ours and Path(ours).expanduser().is_dir() and not its.exists():  # the cold start
            shutil.copytree(Path(ours).expanduser(), its)
        return time_startup(serve_args, cache_dir, timeout)

    main.__globals__["time_startup"] = with_the_config_cache  # this test's copy of the script
    results = main(
        ["--num-warm", "1", "--", str(dummy_dir), "--load-format", "dummy",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", "64",
         "--num-gpu-blocks-override", "16"]
    )  # fmt: skip
    out = capsys.readouterr().out
    # serve's default --background-compile: ready with some shapes, the others after
    line = (
        rf"{NUM} s to ready \(%s (\d+) step shapes in {NUM} s\); "
        rf"the other (\d+) in the background, all in after {NUM} s\n  phases: (.*)$"
    )
    cold = re.search(rf"^Start-up cold: {line % 'compiled'}", out, re.M)
    warm = re.search(rf"^Start-up warm: {line % 'loaded'}", out, re.M)  # saved executables
    assert cold and warm, out
    assert cold.group(1) == warm.group(1) and cold.group(2) == warm.group(2) != "0"
    for phase in ("frontend imports", "engine core: load weights", "step executables"):
        assert phase in cold.group(3) and phase in warm.group(3), out
    assert len(results["cold"]) == len(results["warm"]) == 1
    for run in results["cold"] + results["warm"]:
        assert run["all_ready_s"] > run["ready_s"]


FAKE_VLLM = '''
"""A stand-in for vLLM's Python API: generate() returns max_tokens ids per sample."""
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, n=1, max_tokens=16, **_):
        self.n, self.max_tokens = n, max_tokens


class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))


class _Output:
    def __init__(self, params):
        self.outputs = [_Completion(params.max_tokens) for _ in range(params.n)]


class LLM:
    def __init__(self, model, **kwargs):
        assert kwargs["dtype"] == "float32" and kwargs["max_num_seqs"] == 4, kwargs
        print("vLLM's own log line, on stdout")

    def generate(self, prompts, params, use_tqdm=True):
        return [_Output(params) for _ in prompts]

    def reset_prefix_cache(self):
        return True
'''


def test_bench_latency_vllm_backend_speaks_to_vllms_worker(hf_dir, tmp_path, capsys, monkeypatch):
    """--backend vllm: the worker runs under $JAXSERVE_VLLM_PYTHON (here this Python, with a
    stand-in `vllm` package: vLLM itself lives in a venv of its own), its log lines never mix
    into the replies, and the latency lines come out as for the other backends."""
    (tmp_path / "vllm.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("JAXSERVE_VLLM_PYTHON", sys.executable)
    out_json = tmp_path / "lat.json"
    script("scripts/bench_latency.py")(
        ["--backend", "vllm", "--model", str(hf_dir), "--batch-size", "2", "--input-len", "8",
         "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "2", "--dtype",
         "float32", "--max-num-seqs", "4", "--output-json", str(out_json)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(rf"^Avg latency: {NUM} seconds$", out, re.M)
    assert json.loads(out_json.read_text())["backend"] == "vllm"
    with pytest.raises(ValueError, match="needs an HF model directory"):
        script("scripts/bench_latency.py")(["--backend", "vllm", "--model", "llama-3-8b",
                                            "--load-format", "dummy"])  # fmt: skip


def test_bench_peers_alternates_backends_and_tabulates_medians(hf_dir, tmp_path, capsys,
                                                                monkeypatch):  # fmt: skip
    """A round for real (bench_latency in a process of its own, its JSON read back: the
    stand-in vLLM's, the cheapest backend to start; the backends themselves:
    test_bench_latency*), then three rounds of two backends over two batch sizes with the runs
    stubbed at known latencies: the backends alternate within each round, and the table gives
    the medians and ratios."""
    (tmp_path / "vllm.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("JAXSERVE_VLLM_PYTHON", sys.executable)
    peers = script("benchmarks/bench_peers.py")
    out_json = tmp_path / "peers.json"
    results = peers(
        ["--backends", "vllm", "--batch-sizes", "2", "--rounds", "1", "--output-json",
         str(out_json), "--", "--model", str(hf_dir), "--input-len", "8", "--output-len", "3",
         "--num-iters-warmup", "0", "--num-iters", "1", "--dtype", "float32",
         "--max-num-seqs", "4", "--no-roofline"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(rf"^\| 2 \| {NUM} s \(step nan ms\) \|  \|$", out, re.M)
    (run,) = results["runs"]["2"]["vllm"]
    assert run["backend"] == "vllm" and len(run["latencies"]) == 1  # bench_latency's own JSON
    assert json.loads(out_json.read_text())["table"][0]["batch_size"] == 2

    calls = []
    latencies = {"a": [0.3, 0.1, 0.2], "b": [0.5, 0.9, 0.7]}  # medians 0.2 and 0.7

    def run_once(backend, batch_size, extra):
        calls.append((batch_size, backend))
        latency = latencies[backend][sum(c == calls[-1] for c in calls) - 1] * batch_size
        return {"avg_latency": latency, "decode_step_ms": 10 * latency}

    monkeypatch.setitem(peers.__globals__, "run_once", run_once)
    results = peers(["--backends", "a,b", "--batch-sizes", "1,2", "--rounds", "3"])
    assert calls == [(1, "a"), (1, "b")] * 3 + [(2, "a"), (2, "b")] * 3
    out = capsys.readouterr().out
    assert "| 1 | 0.200 s (step 2.0 ms) | 0.700 s (step 7.0 ms) | 3.50x over b |" in out
    assert "| 2 | 0.400 s (step 4.0 ms) | 1.400 s (step 14.0 ms) | 3.50x over b |" in out
    assert results["table"][1]["median_avg_latency_s"] == {"a": 0.4, "b": 1.4}


def test_bench_cpu_attention(tmp_path, capsys):
    """The CPU kernel's benchmark: a row per (batch, context), both ops timed, JSON written."""
    from pallas_kernels.paged_attention.cpu import cpu_kernel_unavailable_message

    require_or_skip(cpu_kernel_unavailable_message())
    out = tmp_path / "cpu_attention.json"
    argv = ["--batch-sizes", "1", "4", "--contexts", "40", "--iters", "2",
            "--output-json", str(out)]  # fmt: skip
    script("benchmarks/kernels/bench_cpu_attention.py")(argv)
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 2 and table[-1].startswith("| 4 | 40 | ")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 40), (4, 40)]
    assert all(r["cpu_ms"] > 0 and r["reference_ms"] > 0 and r["kv_bytes"] > 0 for r in rows)


def test_bench_host_step(tmp_path, capsys):
    """The runner's host work per step: dispatch + fetch over stubbed executables, and the
    batch builder alone, a row per batch size."""
    out = tmp_path / "host.json"
    script("benchmarks/bench_host_step.py")(
        ["--rows", "4", "8", "--iters", "3", "--output-json", str(out)]
    )
    rows = json.loads(out.read_text())
    assert [r["rows"] for r in rows] == [4, 8]
    assert all(r["step_ms"] >= r["dispatch_ms"] > 0 and r["build_ms"] > 0 for r in rows)


def test_bench_sparse_mla(tmp_path, capsys):
    """DeepSeek Sparse Attention's benchmark in smoke mode (interpreted kernels): a row per
    implementation with the bytes each reads (the chosen rows; dense MLA and the indexer the
    whole context), and the summary lines the GPU suite reports."""
    pytest.importorskip("pallas_kernels.sparse_mla.mosaic", exc_type=ImportError)
    out = tmp_path / "sparse.json"
    script("benchmarks/kernels/bench_sparse_mla.py")(["--smoke", "--output-json", str(out)])
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"sparse_xla", "sparse_mosaic", "dense_triton", "indexer_xla",
                         "indexer_mosaic"}  # fmt: skip
    assert rows["sparse_mosaic"]["bytes"] == rows["sparse_xla"]["bytes"] == 128 * 576 * 2
    assert rows["dense_triton"]["bytes"] == 256 * 576 * 2
    assert rows["indexer_mosaic"]["bytes"] == 256 * 128 * 2
    assert all(r["us"] > 0 for r in rows.values())
    out = capsys.readouterr().out
    assert "# sparse heads 16 batch 1: mosaic " in out and "# sparse indexer batch 1: " in out


def test_bench_kv_transfer(tmp_path, capsys):
    """The KV transfer benchmark end to end at one and two blocks: the connector's fetch and
    the device <-> host copies through the engine's own block gather / scatter (the GPU suite's
    kv_transfer step; it broke once when those took KV-cache groups)."""
    out = tmp_path / "kv.json"
    script("benchmarks/bench_kv_transfer.py")(
        ["--blocks", "1", "2", "--repeats", "1", "--output-json", str(out)]
    )
    rows = json.loads(out.read_text())["rows"]
    paths = ["zmq fetch", "save: device -> host", "load: host -> device"]
    for n in (1, 2):
        found = [r for r in rows if r["blocks"] == n]
        assert sorted(p for p in paths for r in found if r["path"].startswith(p)) == sorted(paths)
        assert all(r["MiB"] == round(n * 30 * 16 * 3 * 128 * 4 / 2**20, 2) for r in found)
        assert all(r["ms"] > 0 and r["GB/s"] >= 0 for r in found)  # (GB/s: 2 decimals)
    assert "| save: device -> host (gather + copy) | 2 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("path", "argv", "line"),
    [
        ("benchmarks/bench_compile.py", ["--layers", "1", "--tokens", "16", "--repeats", "1"],
         rf"^\| 1 \| {NUM} \| {NUM} \| {NUM}x \|$"),
        ("benchmarks/bench_ipc.py", ["--num-requests", "4", "--iters", "10"],
         rf"^step outputs, 4 requests, logprobs=5: \d+ B; encode {NUM} us"),
        ("benchmarks/bench_pipeline.py", ["--step", "1,0.01", "--requests", "2", "--tokens", "3"],
         r"^\| 4 \| 1 \| 1\.00 \| \d+ \| \d+% \|$"),
        ("benchmarks/kernels/bench_gemm_backends.py",
         ["--smoke", "--tokens", "2", "--settings", "default,cublas"],
         rf"^# gemm down T=2: default {NUM} ms; default 1\.00x, cublas {NUM}x$"),
    ],
)  # fmt: skip
def test_quick_benchmarks_run_on_todays_interfaces(path, argv, line, capsys, monkeypatch):
    """The benchmarks nothing else runs that take seconds: each against the engine's current
    interfaces (the KV cache's layout, the output messages' per-token logprobs, the device
    check of pipeline stages each broke one once, unnoticed)."""
    for name in ("XLA_FLAGS", "JAXSERVE_SIMULATED_STEP"):  # what bench_pipeline sets
        monkeypatch.setenv(name, os.environ.get(name, ""))
    script(path)(argv)
    assert re.search(line, capsys.readouterr().out, re.M)


def test_attention_agreement_compares_up_to_the_first_differing_token():
    """A flipped tie still compares its (top) logprob; after it the contexts differ, so the
    request's later steps are left out."""
    compare = runpy.run_path(str(ROOT / "benchmarks/bench_attention_agreement.py"))["compare"]
    ref = dict(seconds=2.0, prompt=[[-1.0, -2.0]], tokens=[[5, 6, 7, 8]],
               decode=[[-0.5, -0.7, -0.9, -1.1]])  # fmt: skip
    got = dict(seconds=1.0, prompt=[[-1.0, -2.5]], tokens=[[5, 9, 1, 1]],
               decode=[[-0.5, -0.71, -9.0, -9.0]])  # fmt: skip
    row = compare(ref, got, batch=1, output_len=4)
    assert row["prompt_max_abs"] == pytest.approx(0.5)
    assert row["decode_max_abs"] == pytest.approx(0.01)  # steps 0 and 1, not 2 and 3
    assert (row["decode_steps"], row["tokens_equal"]) == (2, 0.5)
    assert (row["tok_s"], row["reference_tok_s"]) == (4.0, 2.0)


def test_bench_attention_agreement_runs_the_engine_per_kernel(dummy_dir, tmp_path, capsys,
                                                              inproc):  # fmt: skip
    """The reference attention and the CPU kernel (the Pallas ones run the same worker with
    $JAXSERVE_PALLAS_KERNEL set; interpreted they take ~3x as long), each in its own engine
    process on the same dummy weights: their logprobs agree."""
    out = tmp_path / "agree.json"
    script("benchmarks/bench_attention_agreement.py")(
        ["--model", str(dummy_dir), "--load-format", "dummy", "--dtype", "float32",
         "--max-model-len", "32", "--max-num-seqs", "2", "--max-num-batched-tokens", "8",
         "--batch-sizes", "1", "--input-len", "4", "--output-len", "2", "--kernels", "cpu",
         "--output-json", str(out)]
    )  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["kernel"], row["batch"], row["decode_steps"]) == ("cpu", 1, 2)
    assert row["prompt_max_abs"] < 1e-4 and row["decode_max_abs"] < 1e-4
    assert "# agreement cpu batch 1: prompt max |dlogprob| " in capsys.readouterr().out


def test_profile_decode_replays_a_fused_step(dummy_dir, capsys, monkeypatch):
    """Where decode steps run forward and sampling as one executable (the GPU's default),
    the profile replays it and the two executables of the same shapes beside it."""
    monkeypatch.setenv("JAXSERVE_FUSED_SAMPLING", "1")
    rows = script("benchmarks/profile_decode.py")(
        ["--model", str(dummy_dir), "--load-format", "dummy", "--dtype", "float32",
         "--batch-sizes", "2", "--input-len", "4", "--iters", "2", "--max-model-len", "32",
         "--max-num-batched-tokens", "8"]
    )  # fmt: skip
    assert rows[0]["fused_ms"] > 0 and rows[0]["forward_ms"] > 0 and rows[0]["sampler_ms"] > 0
    assert "| fused_ms |" in capsys.readouterr().out
