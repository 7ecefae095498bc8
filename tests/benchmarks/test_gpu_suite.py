"""scripts/gpu_suite.sh --dry-run on CPU (the kernels interpreted, a tiny dummy model, HF on
CPU): the plumbing of the one device call, proven here so that call does not fail on it.

The whole dry run (every step: `bash scripts/gpu_suite.sh --dry-run --out /tmp/suite`, about
2.5 minutes on 2 cores) is too slow for CI; these run the steps whose scripts nothing else
here runs end to end (the environment, copy rate, the HF peer, the profiler trace) and the
budget's ranking, and test_gpu_suite_report.py tests the report on the lines each benchmark
prints. The latency steps are planned, not run (one run: 10-16 s, as long as these four):
their commands must parse as bench_latency's flags, and test_bench_scripts.py runs
bench_latency end to end and reads its lines with this report's parser."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["GPU_SUITE_COMMIT"] = "abc1234"  # an exact commit, whatever the tree here
    # one device (the suite's GPU machine has one); conftest's code-generation flags
    env["XLA_FLAGS"] = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    proc = subprocess.run(
        ["bash", "scripts/gpu_suite.sh", "--dry-run", "--out", str(out), "--work", str(work),
         *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    return proc, out, work


def test_dry_run_of_the_new_steps_reports_each(tmp_path):
    steps = ["env", "copy_rate", "hf_peer", "profile_b2"]
    proc, out, work = dry_run(tmp_path, "--steps", ",".join(steps), "--budget", "300")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    ran = [line.split("\t")[:2] for line in (work / "steps.tsv").read_text().splitlines()]
    assert ran == [[name, "ok"] for name in steps]

    report = (out / "gpu-cpu.md").read_text()
    assert report.startswith("# GPU suite: cpu\n")  # GPU_SUITE_COMMIT: an exact commit
    assert "**dry run on CPU**" in report and "| commit | abc1234 |" in report
    rows = {m[1]: m[2] for m in re.finditer(r"^\| (\w+) \| \d+ \| ok \| \d+ \| (.*) \|$",
                                            report, re.M)}  # fmt: skip
    assert list(rows) == steps
    assert "jaxserve imports" in rows["env"]
    assert re.fullmatch(
        r"\*\*[0-9]+ GB/s\*\* \(median of 5, best [0-9.]+ GB/s; 2 x 64 MiB a "
        r"call\) on cpu; no datasheet figure for this device",
        rows["copy_rate"],
    )
    assert re.fullmatch(r"batch 2: decode step -?[0-9.]+ ms; batch 1: decode step -?[0-9.]+ ms",
                        rows["hf_peer"])  # fmt: skip
    assert re.match(r"step [0-9.]+ ms traced: attention [0-9.]+ ms \(\d+%\), matmul ",
                    rows["profile_b2"])  # fmt: skip
    # HF beside jaxserve, at each batch HF ran (no latency step ran: no jaxserve figure); a
    # step this short on a loaded 2-core CPU can come out below zero (a difference of medians)
    assert re.search(r"^\| 1 \| - \| -?[0-9.]+ \| - \|$", report, re.M)
    assert re.search(r"^\| 2 \| - \| -?[0-9.]+ \| - \|$", report, re.M)
    assert "**Must-show**: no jaxserve step at batch 2 (latency_b2 did not run)" in report
    trace = report[report.index("## Decode-step profile (profile_b2") :]
    assert re.search(r"^\| attention \| [0-9.]+ \| \d+% \| [1-9]\d* \|$", trace, re.M)
    assert re.search(r"^\| matmul \| [0-9.]+ \| \d+% \| [1-9]\d* \|$", trace, re.M)
    assert re.search(r"^\| sampler \| [0-9.]+ \| \d+% \| [1-9]\d* \|$", trace, re.M)
    assert re.search(r"^\| gaps \(device idle\) \| [0-9.]+ \| \d+% \| - \|$", trace, re.M)
    with tarfile.open(out / "gpu-suite-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{name}.log" for name in steps} | {"steps.tsv", "plan.tsv", "env.json"} <= names
    assert {"copy_rate.json", "hf_peer.json"} <= names
    assert not (ROOT / "benchmarks" / "results" / "gpu-cpu.md").exists()  # a dry run's stays out


def test_the_dry_runs_latency_commands_are_bench_latencys_flags(tmp_path):
    """The latency steps, planned with no time to run (all dropped, in a second): each command
    is scripts/bench_latency.py with flags its parser takes and the engine's arguments build
    from, at the dry run's sizes, writing its JSON into the work directory."""
    from jaxserve.benchmarks.latency import parse_args
    from jaxserve.entrypoints.cli_args import engine_args_from

    proc, _, work = dry_run(tmp_path, "--steps", "latency", "--budget", "1")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    plan = [line.split("\t") for line in (work / "plan.tsv").read_text().splitlines()]
    assert [(row[0], row[2]) for row in plan] == [("latency_b1", "model"), ("latency_b2", "model")]
    for batch, (name, *_, command) in enumerate(plan, 1):
        command = shlex.split(command)
        assert command[1] == "scripts/bench_latency.py"
        args = parse_args(command[2:])
        assert (args.batch_size, args.repeats, args.num_iters, args.output_len) == (batch, 3, 2, 3)
        assert args.output_json == str(work / f"{name}.json") and args.load_format == "dummy"
        engine = engine_args_from(args)
        assert engine.model == str(work / "tiny-llama") and engine.max_num_seqs == 2
    ran = [line.split("\t")[:2] for line in (work / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in ran] == ["latency_b1", "latency_b2"]
    assert all(r[1].startswith("dropped: no time") for r in ran)


def test_the_budget_drops_a_lower_ranked_step_that_runs_earlier(tmp_path):
    """env runs before copy_rate, but --rank puts copy_rate first: with time for one of the
    two (each is expected to take 5 s in a dry run; 22 s less the 15 s kept for the report
    leave ~7), env is dropped and copy_rate runs."""
    proc, out, work = dry_run(tmp_path, "--steps", "env,copy_rate", "--rank", "copy_rate",
                              "--budget", "22")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    ran = [line.split("\t")[:2] for line in (work / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in ran] == ["env", "copy_rate"]
    assert ran[0][1].startswith("dropped: no time (rank 2: expected 5 s") and ran[1][1] == "ok"
    report = (out / "gpu-cpu.md").read_text()
    assert "| 1 | copy_rate | 5 | 60 | ok" in report  # (" in N s" from 1 s on)
    assert "| 2 | env | 5 | 60 | dropped: no time (rank 2" in report
    assert "Dropped: env." in report
