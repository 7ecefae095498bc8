"""benchmarks/kernels/bench_paged_attention.py runs and prints its table (format, not speed)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_prints_a_row_per_case_and_writes_json(tmp_path):
    out = tmp_path / "kernel.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/kernels/bench_paged_attention.py", "--smoke",
         "--output-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| decode") or
            line.startswith("| mixed")]  # fmt: skip
    assert len(rows) == 3  # decode b=1, b=4, one mixed case
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["results"]] == [r.split(" | ")[0][2:] for r in rows]
    for r in data["results"]:
        assert r["kernel_us"] > 0 and r["reference_us"] > 0
        assert r["max_abs_err"] < 2e-2  # bf16 kernel vs bf16 reference
