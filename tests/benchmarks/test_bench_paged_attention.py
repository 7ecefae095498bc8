"""benchmarks/kernels/bench_paged_attention.py runs and prints its table (format, not speed):
every implementation through the timed chain over rotated cache copies, jax's own decode
kernel included (interpreted), each checked against the reference."""

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
        assert r["cache_copies"] == 2  # calls rotate over two copies of the cache
    decodes = [r for r in data["results"] if r["case"].startswith("decode")]
    for r in decodes:  # jax's own decode kernel, interpreted, on the same batch
        assert r["jax_pallas_us"] > 0 and r["jax_pallas_max_abs_err"] < 2e-2
