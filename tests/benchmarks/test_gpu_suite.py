"""scripts/gpu_suite.sh --dry-run: the GPU suite's every step runs on CPU (the kernel interpreted,
a tiny dummy model, few iterations) and the report names each step's status and figures. The
pipeline is proven here so the one device call that runs it for real does not fail on it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The headline model runs before the rest, the tuning sweep last (in the time left).
STEPS = ["env", "pytest_gpu", "kernel_bench", "kv_transfer", "latency_b1", "throughput_2",
         "kernel_bench_mla", "tune_kernel"]  # fmt: skip


def test_dry_run_runs_every_step_and_reports_each(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    # one device (the suite's GPU machine has one); conftest's code-generation flags
    env["XLA_FLAGS"] = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    proc = subprocess.run(
        ["bash", "scripts/gpu_suite.sh", "--dry-run", "--out", str(out), "--work", str(work),
         "--budget", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    steps = [line.split("\t") for line in (work / "steps.tsv").read_text().splitlines()]
    assert [(s[0], s[1]) for s in steps] == [(name, "ok") for name in STEPS]

    report = (out / "gpu-cpu.md").read_text()
    assert "**dry run on CPU**" in report
    assert re.search(r"^\| jax \| \d+\.\d+\.\d+ ", report, re.M)
    assert re.search(r"^\| commit \| [0-9a-f]{7,}", report, re.M)
    rows = {m[1]: m[2] for m in re.finditer(r"^\| (\w+) \| ok \| \d+ \| (.*) \|$", report, re.M)}
    assert list(rows) == STEPS
    assert "jaxserve imports" in rows["env"]
    # no GPU: the gpu tests skip, the CUDA lowering tests pass
    assert re.search(r"^\d+ passed, \d+ skipped, \d+ deselected", rows["pytest_gpu"])
    assert rows["kernel_bench"].startswith("3 cases")
    assert re.search(r"zmq fetch .*: [\d.]+ GB/s; save: .*; load: .* GB/s", rows["kv_transfer"])
    kernel = report[report.index("## Paged-attention kernel") : report.index("## Kernel tuning")]
    kernel, mla = kernel.split("## Paged-attention kernel: MLA")
    assert len(re.findall(r"^\| (?:decode|mixed) .* \|$", kernel, re.M)) == 3
    # DeepSeek's latent attention: the same cases, no jax peer (it has no MLA kernel)
    assert "MLA, latent 64" in mla and rows["kernel_bench_mla"].startswith("2 cases")
    assert len(re.findall(r"^\| (?:decode|mixed) .* \| - \| [0-9.e+-]+ \|$", mla, re.M)) == 2
    # the kernel benchmark: every implementation timed over rotated cache copies, jax's own
    # decode kernel included (interpreted), each checked against the reference
    results = json.loads((work / "kernel_bench.json").read_text())["results"]
    assert [r["case"] for r in results] == ["decode b=1 ctx=40", "decode b=4 ctx=40",
                                            "mixed 1x40-chunk + 3 decodes ctx=40"]  # fmt: skip
    for r in results:
        assert r["kernel_us"] > 0 and r["reference_us"] > 0
        assert r["max_abs_err"] < 2e-2  # bf16 kernel vs bf16 reference
        assert r["cache_copies"] == 2  # calls rotate over two copies of the cache
        if r["case"].startswith("decode"):
            assert r["jax_pallas_us"] > 0 and r["jax_pallas_max_abs_err"] < 2e-2
    # a dry run's tiny steps are noise: the derived decode step may come out negative
    assert re.search(r"avg latency [0-9.]+ s; decode step -?[0-9.]+ ms", rows["latency_b1"])
    assert "of the HBM bound" in rows["latency_b1"]
    assert "output tok/s" in rows["throughput_2"]
    assert "of the HBM bound" in rows["throughput_2"]  # one batch: the roofline follows
    assert rows["tune_kernel"] == "6 configurations, 3 cases; best per case below"
    sweep = report[report.index("## Kernel tuning sweep") :]
    assert len(re.findall(r"^- best ", sweep, re.M)) == 3
    assert len(re.findall(r"^\| (?:decode|mixed) \| .* \| [0-9.]+x \|$", sweep, re.M)) == 6

    assert "=== throughput_2: ok" in (out / "suite.log").read_text()
    with tarfile.open(out / "gpu-suite-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{name}.log" for name in STEPS} | {"steps.tsv", "env.json"} <= names
    assert not (ROOT / "benchmarks" / "results" / "gpu-cpu.md").exists()  # a dry run's stays out
