"""scripts/gpu_suite_report.py as units: the budget plan (ranks, drops, limits), the kernel
choice, and the report on a synthetic WORK directory (the lines the benchmarks print)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from pallas_kernels.paged_attention.choice import choose_kernel
from tests.pallas_kernels.test_kernel_choice import CALL

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("gpu_suite_report", ROOT / "scripts" / "gpu_suite_report.py")


def _plan(*rows):
    """(name, rank, kind, expected, limit) in the order the steps run."""
    return [dict(name=n, rank=r, kind=k, expected=e, limit=lim, command="")
            for n, r, k, e, lim in rows]  # fmt: skip


def test_the_plan_drops_the_lowest_ranked_step_first_wherever_it_runs():
    # run order: b (rank 3) before a (rank 1) and c (rank 2)
    plan = _plan(("b", 3, "other", 50, 100), ("a", 1, "other", 50, 100),
                 ("c", 2, "other", 50, 100))  # fmt: skip
    assert report.plan_step(plan, {}, "b", 200) == ("run", 100)  # all fit
    # 120 s: a and c take 100; b, first in order but last in rank, goes
    decision, why = report.plan_step(plan, {}, "b", 120)
    assert decision == "drop" and "rank 3: expected 50 s; 20 s of the 120 s left" in why
    # then a runs, its limit cut so that c (below it) is not reserved for
    assert report.plan_step(plan, {"b": "dropped: x"}, "a", 120) == ("run", 100)
    # c, ranked above b, runs before it would: b's limit leaves a and c their 100 s
    assert report.plan_step(plan, {}, "b", 170) == ("run", 70)


def test_a_step_too_big_for_the_time_left_gives_way_to_smaller_lower_ranked_ones():
    plan = _plan(("big", 1, "other", 100, 200), ("small", 2, "other", 20, 60))
    assert report.plan_step(plan, {}, "big", 60)[0] == "drop"
    assert report.plan_step(plan, {"big": "dropped: x"}, "small", 60) == ("run", 60)


def test_the_first_model_run_is_expected_to_compile():
    plan = _plan(("lat", 1, "model", 40, 150), ("tp", 2, "model", 40, 150),
                 ("kern", 3, "other", 30, 90))  # fmt: skip
    # cold: lat expects 40 + 100 and may run 250; kern does not fit beside lat and tp
    assert report.plan_step(plan, {}, "lat", 200, compile_s=100) == ("run", 200)
    assert report.plan_step(plan, {}, "lat", 400, compile_s=100) == ("run", 250)
    # lat failed: tp is the first to compile now
    assert report.plan_step(plan, {"lat": "failed"}, "tp", 150, compile_s=100) == ("run", 150)
    # lat ran: the cache is warm, tp expects 40 and kern fits beside it
    assert report.plan_step(plan, {"lat": "ok"}, "tp", 80, compile_s=100) == ("run", 80)
    assert report.plan_step(plan, {"lat": "ok"}, "kern", 70, compile_s=100) == ("run", 30)


KERNEL_LOG = """\
# NVIDIA H100 80GB HBM3 (gpu), jax 0.11.2, x86_64; Hq=32 Hkv=8 D=128 block=16 bfloat16
# peak HBM bandwidth: 3.35 TB/s
# kernels: triton, mosaic
| case | kernel | kernel us | KV GB/s | of peak | vs XLA reference | vs jax Pallas decode | max abs err |
|---|---|---|---|---|---|---|---|
| decode b=256 ctx=33-160 (e2e) | triton | 100.0 | 2000 | 60% | 5.00x | 1.10x | 9.8e-04 |
| decode b=256 ctx=33-160 (e2e) | mosaic | 80.0 | 2500 | 75% | 6.25x | 1.38x | 9.8e-04 |
| decode b=1 ctx=512 | triton | 20.0 | 100 | 3% | 30.00x | 1.00x | 9.8e-04 |
| decode b=1 ctx=512 | mosaic | 25.0 | 80 | 2% | 24.00x | 0.80x | 9.8e-04 |
| decode b=16 ctx=512 | triton | 40.0 | 800 | 24% | 13.00x | 0.90x | 2.0e-03 |
| decode b=16 ctx=512 | mosaic | 30.0 | 1066 | 32% | 17.33x | 1.20x | 2.0e-03 |
| mixed 1x512-chunk + 255 decodes ctx=512 | triton | 300.0 | 1700 | 51% | 9.00x | - | 1.6e-02 |
| mixed 1x512-chunk + 255 decodes ctx=512 | mosaic | 330.0 | 1545 | 46% | 8.18x | - | 1.6e-02 |
"""  # noqa: E501


def test_the_kernel_choice_weighs_the_decode_and_mixed_medians():
    choice = report.kernel_choice(KERNEL_LOG)
    # decode: 100/80, 20/25, 40/30 -> median 1.25; mixed: 300/330 -> 0.909; mean 1.066
    assert choice["mosaic_speedup"] == {"decode": 1.25, "mixed": 0.909}
    assert (choice["decode"], choice["mixed"], choice["kernel"]) == ("mosaic", "triton", "mosaic")
    assert choice["cases"] == 4
    slower = KERNEL_LOG.replace("| mosaic | 330.0 |", "| mosaic | 400.0 |")
    assert report.kernel_choice(slower)["kernel"] == "triton"  # sqrt(1.25 * 0.75) < 1


def test_without_mosaic_the_choice_is_triton_and_says_why():
    log = "\n".join(line for line in KERNEL_LOG.splitlines() if "| mosaic |" not in line)
    log = log.replace("# kernels: triton, mosaic", "# mosaic: unavailable (ImportError: no)\n"
                      "# kernels: triton")  # fmt: skip
    choice = report.kernel_choice(log)
    assert choice["kernel"] == "triton" and choice["mosaic_speedup"] == {}
    assert "mosaic: unavailable (ImportError: no)" in choice["reason"]


def test_kernel_choice_file_keeps_other_devices(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "kernel_bench.log").write_text(KERNEL_LOG)
    (work / "env.json").write_text(json.dumps({"device_kind": "NVIDIA H100 80GB HBM3",
                                               "jax": "0.11.2"}))  # fmt: skip
    (work / "suite.txt").write_text("commit=abc1234\n")
    (work / "steps.tsv").write_text("pytest_gpu\tfailed\t1\t90\t240\tpytest\n")
    dest = tmp_path / "kernel_choice.json"
    dest.write_text(json.dumps({"format": 1, "devices": {"NVIDIA H200": {"kernel": "triton"}}}))
    assert report.main(["kernel-choice", str(work), str(dest)]) == 0
    h100 = json.loads(dest.read_text())["devices"]["NVIDIA H100 80GB HBM3"]
    assert h100["kernel"] == "triton" and "GPU tests" in h100["reason"]  # faster, not shown right
    (work / "steps.tsv").write_text("pytest_gpu\tok\t0\t90\t240\tpytest\n")
    assert report.main(["kernel-choice", str(work), str(dest)]) == 0
    table = json.loads(dest.read_text())
    assert table["format"] == 1 and table["devices"]["NVIDIA H200"] == {"kernel": "triton"}
    h100 = table["devices"]["NVIDIA H100 80GB HBM3"]
    assert (h100["kernel"], h100["commit"], h100["jax"]) == ("mosaic", "abc1234", "0.11.2")
    assert choose_kernel("NVIDIA H100 80GB HBM3", override=None, table=dest, **CALL) == "mosaic"
    assert choose_kernel("NVIDIA H200", override=None, table=dest, **CALL) == "triton"


def _latency_log(step_ms: float, tok_s: float, bound_ms: float) -> str:
    return (
        f"Avg latency: 0.85 seconds\n"
        f"Decode step: {step_ms:.2f} ms (median of 3 runs: {step_ms:.2f}, {step_ms + 0.1:.2f}, "
        f"{step_ms - 0.1:.2f} ms; each (avg latency - avg at one output token) / 127); "
        f"{tok_s:.1f} tokens/s\n"
        f"Roofline: step {step_ms:.2f} ms, memory bound {bound_ms:.2f} ms "
        f"({bound_ms / step_ms:.2f} of it), compute bound 0.10 ms (0.02 of it)\n"
        f"  per step 15317.0 MiB of weights + 20.00 MiB of KV read, 16.00 GFLOP; NVIDIA H100 "
        f"80GB HBM3: 3350.0 GB/s, 989000 GFLOP/s (datasheet)\n"
    )


def make_work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    steps = [
        ("env", "ok", "0", "7", "90"),
        ("copy_rate", "ok", "0", "9", "60"),
        ("latency_b1", "ok", "0", "140", "250"),
        ("hf_peer", "ok", "0", "100", "240"),
        ("latency_b32", "ok", "0", "40", "150"),
        ("kernel_bench", "timeout", "124", "240", "240"),
        ("profile_b256", "dropped: no time (rank 10: ...)", "-", "0", "180"),
    ]
    (work / "steps.tsv").write_text("".join("\t".join([*s, f"cmd {s[0]}"]) + "\n"
                                            for s in steps))  # fmt: skip
    plan = [("env", 1, "other", 10, 90), ("copy_rate", 2, "other", 15, 60),
            ("latency_b1", 4, "model", 45, 150), ("hf_peer", 6, "other", 120, 240),
            ("latency_b32", 7, "model", 45, 150), ("kernel_bench", 8, "other", 120, 240),
            ("profile_b256", 10, "model", 60, 180)]  # fmt: skip
    (work / "plan.tsv").write_text("".join("\t".join(map(str, p)) + "\tcmd\n" for p in plan))
    (work / "plan.txt").write_text("compile_s=100\n")
    (work / "suite.txt").write_text(
        "mode=gpu\nbudget=540\nelapsed=530\ncommit=abc1234\nexact=0\n"
        "dirty=jaxserve/a.py pallas_kernels/b.py \ndevice_hint=NVIDIA H100 80GB HBM3\n"
    )
    (work / "env.json").write_text(
        json.dumps(
            {
                "jax": "0.11.2",
                "backend": "gpu",
                "device_kind": "NVIDIA H100 80GB HBM3",
                "nvidia_smi": {
                    "name": "NVIDIA H100 80GB HBM3",
                    "driver": "580",
                    "memory": "81559 MiB",
                },
                "devices": ["cuda:0"],
                "packages": {"jaxlib": "0.11.2"},
                "imports": {"x": "ok"},
            }
        )
    )
    (work / "copy_rate.log").write_text(
        "Copy rate: 3000.0 GB/s (median of 20, best 3010.0 GB/s; 2 x 4096 MiB a call) on "
        "NVIDIA H100 80GB HBM3\n")  # fmt: skip
    (work / "copy_rate.json").write_text(json.dumps({"copy_gbps": 3000.0}))
    (work / "latency_b1.log").write_text(_latency_log(6.00, 166.7, 4.80))
    (work / "latency_b32.log").write_text(_latency_log(6.50, 4923.1, 4.90))
    (work / "hf_peer.log").write_text(
        "# HF transformers 5.17.0, torch 2.11 on NVIDIA H100 80GB HBM3; ...\n"
        "HF peer: batch 32: decode step 12.55 ms, 2549.8 tokens/s (latency 1.6 s at 128 "
        "tokens, 0.05 s at 1; warm-up 40.0 s)\n"
        "HF peer: batch 1: decode step 19.97 ms, 50.1 tokens/s (latency 2.6 s at 128 tokens, "
        "0.04 s at 1; warm-up 30.0 s)\n")  # fmt: skip
    (work / "kernel_bench.log").write_text(KERNEL_LOG)
    return work


def test_the_report_gives_fractions_against_the_copy_rate_and_the_hf_comparison(tmp_path):
    work = make_work(tmp_path)
    name, text = report.build_report(work)
    assert name == "gpu-nvidia-h100-80gb-hbm3.md"
    lines = text.splitlines()
    # not an exact commit: said first, loudly
    assert lines[0].startswith("**NOT AN EXACT COMMIT: abc1234 with uncommitted changes to "
                               "jaxserve/a.py pallas_kernels/b.py")  # fmt: skip
    assert "| commit | abc1234 **+ uncommitted changes** to 2 tracked files |" in lines
    assert ("| memory bandwidth | datasheet 3350 GB/s; measured copy rate 3000 GB/s (90% of "
            "the datasheet) |") in lines  # fmt: skip
    row = re.compile(r"^\| (\w+) \| (\d+) \| ([^|]+) \| (\d+) \| (.*) \|$", re.M)
    rows = {m[1]: m.groups()[1:] for m in row.finditer(text)}  # rank, status, seconds, figures
    assert rows["copy_rate"][3].startswith("**3000 GB/s** (median of 20")
    assert rows["copy_rate"][3].endswith("90% of the datasheet 3350 GB/s")
    # 4.80 ms at 3350 GB/s is 5.36 ms at 3000: 80% and 89% of the 6.00 ms step
    lat = rows["latency_b1"][3]
    assert "decode step 6.00 ms (median of 3: 6.00, 6.10, 5.90 ms), 166.7 tok/s" in lat
    assert "**80% of the HBM bound** (memory bound 4.80 ms / step at 3350 GB/s, datasheet" in lat
    assert "**89%** of the bound at the copy rate, 5.36 ms" in lat
    assert rows["kernel_bench"][:2] == ("8", "**timeout** (killed at 240 s)")
    assert ("best 2500 GB/s (mosaic, decode b=256 ctx=33-160 (e2e)): **75% of the datasheet**, "
            "**83% of the copy rate**") in rows["kernel_bench"][3]  # fmt: skip
    assert rows["profile_b256"][1].startswith("dropped: no time")
    # HF beside jaxserve at each batch HF ran; the must-show at the largest
    assert "| 1 | 6.00 | 19.97 | 3.33x |" in lines
    assert "| 32 | 6.50 | 12.55 | 1.93x |" in lines
    assert "**Must-show**: jaxserve is 1.93x HF at batch 32: >= 2x? **NO**" in lines
    # the kernel table: a column of the copy rate; the choice
    assert ("| decode b=256 ctx=33-160 (e2e) | mosaic | 80.0 | 2500 | 75% | 83% | 6.25x | 1.38x "
            "| 9.8e-04 |") in lines  # fmt: skip
    assert any(
        line.startswith("NVIDIA H100 80GB HBM3: **mosaic** (geometric mean") for line in lines
    )
    # the budget: every planned step by rank, the dropped named
    budget = text[text.index("## Budget") :]
    assert "| 10 | profile_b256 | 60 | 180 | dropped: no time (rank 10: ...) |" in budget
    assert "| 4 | latency_b1 | 45 | 150 | ok in 140 s |" in budget
    assert "Dropped: profile_b256." in budget
    assert "## Failures" in text and "### kernel_bench (**timeout** (killed at 240 s))" in text


def test_an_exact_commit_has_no_warning_and_the_trace_table_is_kept(tmp_path):
    work = make_work(tmp_path)
    suite = (work / "suite.txt").read_text().replace("exact=0", "exact=1")
    (work / "suite.txt").write_text(
        suite.replace("dirty=jaxserve/a.py pallas_kernels/b.py ", "dirty=")
    )
    with (work / "steps.tsv").open("a") as f:
        f.write("profile_b8\tok\t0\t50\t180\tcmd\n")
    table = ["| op class | ms / step | of the step | ops / step |", "|---|---|---|---|",
             "| attention | 0.500 | 6% | 32 |", "| matmul | 5.000 | 60% | 224 |",
             "| sampler | 0.700 | 8% | 20 |", "| elementwise | 1.000 | 12% | 400 |",
             "| copy | 0.010 | 0% | 2 |", "| gaps (device idle) | 1.100 | 13% | - |",
             "| step (first op to last) | 8.310 | 100% | 678 |"]  # fmt: skip
    (work / "profile_b8.log").write_text(
        "Trace summary: decode step at batch 8, 10 engine steps, 6780 ops (device Stream "
        "threads), /tmp/t.json.gz\n" + "\n".join(table) + "\n\n| batch | engine_ms |\n"
    )
    _, text = report.build_report(work)
    assert text.startswith("# GPU suite: NVIDIA H100 80GB HBM3\n")
    assert "| commit | abc1234 |" in text
    section = text[text.index("## Decode-step profile (profile_b8") :].split("\n## ")[0]
    assert "\n".join(table) in section and "| batch |" not in section
    row = re.search(r"^\| profile_b8 \| 0 \| ok \| 50 \| (.*) \|$", text, re.M)[1]
    assert row == ("step 8.310 ms traced: attention 0.500 ms (6%), matmul 5.000 ms (60%), "
                   "sampler 0.700 ms (8%), elementwise 1.000 ms (12%), gaps (device idle) "
                   "1.100 ms (13%)")  # fmt: skip


def test_the_kernel_bench_records_an_unavailable_kernel_and_goes_on(tmp_path, monkeypatch, capsys):
    """Mosaic not importable: the table says why, the Triton kernel's rows are all there,
    and the kernel choice falls back to it."""
    monkeypatch.setitem(sys.modules, "pallas_kernels.paged_attention.mosaic", None)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "kernels"))
    bench = _load("bench_paged_attention", ROOT / "benchmarks/kernels/bench_paged_attention.py")
    out_json = tmp_path / "k.json"
    bench.main(["--smoke", "--kernels", "triton,mosaic", "--output-json", str(out_json)])
    log = capsys.readouterr().out
    assert re.search(r"^# mosaic: unavailable \((ModuleNotFound|Import)Error: .*\)$", log, re.M)
    _, rows = report.kernel_rows(log)
    assert [(r[0], r[1]) for r in rows] == [
        ("decode b=3 ctx=33-40 (e2e)", "triton"), ("decode b=2 ctx=40", "triton"),
        ("mixed 1x40-chunk + 1 decodes ctx=40", "triton")]  # fmt: skip
    saved = json.loads(out_json.read_text())
    assert saved["kernels"] == ["triton"] and "mosaic" in saved["unavailable"]
    for r in saved["results"]:
        assert r["kernel_us"] > 0 and r["reference_us"] > 0 and r["cache_copies"] == 2
        assert r["max_abs_err"] < 2e-2  # bf16 kernel vs bf16 reference
    assert report.kernel_choice(log)["kernel"] == "triton"
    assert bench.e2e_contexts(256, 33, 160)[::85] == [33, 75, 117, 160]


@pytest.mark.parametrize("device", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe"])
def test_datasheet_bandwidth_by_device_name(device):
    want = {"NVIDIA H100 80GB HBM3": 3350, "NVIDIA H200": 4800, "NVIDIA H100 PCIe": 2000}
    assert report.datasheet_gbps(device) == want[device]


def test_packed_formats_beside_bf16_with_issue_67s_targets(tmp_path):
    """q8b_<format>_b<B> steps (the 8B model with packed dummy weights): each decode step
    beside latency_b<B>'s bf16 step of the same run, the speed-up against its must-show; a
    failed step (no decode line) gives no row."""
    work = make_work(tmp_path)
    extra = [("q8b_int4_b1", "ok"), ("q8b_fp8_block_b32", "ok"), ("q8b_int4_b32", "failed")]
    with (work / "steps.tsv").open("a") as f:
        f.writelines(f"{n}\t{s}\t0\t150\t260\tcmd {n}\n" for n, s in extra)
    with (work / "plan.tsv").open("a") as f:
        f.writelines(f"{n}\t{11 + i}\tother\t150\t260\tcmd\n" for i, (n, _) in enumerate(extra))
    (work / "q8b_int4_b1.log").write_text(_latency_log(2.50, 400.0, 1.40))
    (work / "q8b_fp8_block_b32.log").write_text(_latency_log(5.00, 6400.0, 2.60))
    (work / "q8b_int4_b32.log").write_text("Traceback ...\nValueError: no\n")
    _, text = report.build_report(work)
    lines = text.splitlines()
    table = lines.index("| format | batch | packed ms | bf16 ms | speed-up | must-show |")
    assert lines[table + 2 :][:2] == [
        "| fp8_block | 32 | 5.00 | 6.50 | 1.30x | - |",
        "| int4 | 1 | 2.50 | 6.00 | 2.40x | >= 2.0x? yes |",
    ]
    assert not lines[table + 4].startswith("| int4 | 32")
    row = next(line for line in lines if line.startswith("| q8b_int4_b1 |"))
    assert "decode step 2.50 ms" in row
