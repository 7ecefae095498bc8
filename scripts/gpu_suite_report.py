"""scripts/gpu_suite.sh's helper: `env` records the machine, `plan` decides whether a step
runs in the budget left, `report` writes the markdown, `kernel-choice` the kernel table.

    python scripts/gpu_suite_report.py env WORK        # WORK/env.json (imports jax, jaxserve)
    python scripts/gpu_suite_report.py plan WORK STEP SECONDS_LEFT   # "run LIMIT" / "drop WHY"
    python scripts/gpu_suite_report.py report WORK DIR [DIR ...]   # DIR/gpu-<device>.md
    python scripts/gpu_suite_report.py kernel-choice WORK FILE     # FILE: kernel_choice.json

The report reads what the suite left in WORK: steps.tsv (one line per step: name, status,
exit code, seconds, limit, command), each step's log (NAME.log), env.json and suite.txt (mode,
budget, commit), plan.tsv (the step table: name, rank, kind, expected and limit seconds,
command). Figures are parsed from the logs, the lines the benchmarks print, so a step cut
off by its time limit still reports what it printed. Bandwidth fractions are given against
the datasheet and against the copy rate copy_rate measured. Nothing here imports anything
heavy: the suite calls it before and after every step, so a suite killed midway still leaves
a report.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.metadata
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax",
            "orbax-checkpoint", "numpy", "ml_dtypes", "transformers", "tokenizers", "pyzmq",
            "msgspec", "starlette", "uvicorn", "gguf", "llguidance", "pytest")  # fmt: skip
# What the suite needs to import; a failure here names the missing wheel early.
MODULES = ("jaxserve.entrypoints.cli", "jaxserve.entrypoints.openai.api_server",
           "jaxserve.engine.core_proc", "pallas_kernels.paged_attention.kernel")  # fmt: skip
NUM = r"[-+0-9.e]+|nan|inf"
FAILURE_TAIL = 40  # log lines shown per failed step


# ---------------------------------------------------------------------------------- env
def nvidia_smi() -> dict | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else ""
    parts = [p.strip() for p in line.split(",")]
    return dict(zip(("name", "driver", "memory"), parts, strict=False)) if line else None


def collect_env(work: Path) -> int:
    info: dict = dict(python=sys.version.split()[0], platform=platform.platform(),
                      nvidia_smi=nvidia_smi(), packages={}, imports={})  # fmt: skip
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info["packages"][name] = importlib.metadata.version(name)
    failed = 0
    try:
        import jax

        devices = jax.devices()
        info.update(jax=jax.__version__, backend=jax.default_backend(),
                    device_kind=devices[0].device_kind, platform_name=devices[0].platform,
                    devices=[str(d) for d in devices])  # fmt: skip
    except Exception as e:  # recorded, not fatal
        info["jax_error"] = f"{type(e).__name__}: {e}"
        failed += 1
    for module in MODULES:
        try:
            importlib.import_module(module)
            info["imports"][module] = "ok"
        except Exception as e:
            info["imports"][module] = f"{type(e).__name__}: {e}"
            failed += 1
    (work / "env.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
    return 1 if failed else 0


# ------------------------------------------------------------------------------- report
def read_steps(work: Path) -> list[dict]:
    steps = []
    path = work / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, status, rc, seconds, limit, command = (line.split("\t") + [""] * 6)[:6]
            steps.append(dict(name=name, status=status, rc=rc, seconds=seconds, limit=limit,
                              command=command))  # fmt: skip
    return steps


def read_kv(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def device_name(env: dict, suite: dict) -> str:
    smi = env.get("nvidia_smi") or {}
    return smi.get("name") or env.get("device_kind") or suite.get("device_hint") or "unknown"


def sanitise(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _search(pattern: str, text: str) -> re.Match | None:
    found = list(re.finditer(pattern, text, re.M))
    return found[-1] if found else None


# Datasheet memory bandwidth (GB/s) by device name; the first match wins.
DATASHEET_GBPS = (("H100 PCIe", 2000.0), ("H200", 4800.0), ("H100", 3350.0),
                  ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0))  # fmt: skip


def datasheet_gbps(device: str) -> float | None:
    for key, gbps in DATASHEET_GBPS:
        if key in device:
            return gbps
    return None


def copy_rate(work: Path, log: str = "") -> float | None:
    """The measured copy rate (GB/s, read + write): copy_rate.json, else its log line."""
    path = work / "copy_rate.json"
    if path.exists():
        with contextlib.suppress(ValueError, KeyError):
            return float(json.loads(path.read_text())["copy_gbps"])
    m = _search(rf"^Copy rate: ({NUM}) GB/s", log)
    return float(m[1]) if m else None


def roofline_figures(log: str, copy_gbps: float | None = None) -> str | None:
    """The step's memory bound as a fraction of it, at the roofline's bandwidth (the
    datasheet's on a GPU) and at the measured copy rate."""
    m = _search(rf"^Roofline: step ({NUM}) ms, memory bound ({NUM}) ms \(({NUM}) of it\)", log)
    if not m:
        return None
    step, bound = float(m[1]), float(m[2])
    text = f"**{float(m[3]):.0%} of the HBM bound** (memory bound {m[2]} ms / step"
    d = _search(rf"^  per step .*: ({NUM}) GB/s, .*\((\w+)", log)
    if d:
        text += f" at {float(d[1]):.0f} GB/s, {d[2]}"
        if copy_gbps and step > 0:
            at_copy = bound * float(d[1]) / copy_gbps
            text += f"; **{at_copy / step:.0%}** of the bound at the copy rate, {at_copy:.2f} ms"
    return text + ")"


def pytest_figures(log: str) -> str:
    m = _search(r"^=* ?(\d+ (?:passed|failed|skipped|deselected|errors?)\b.* in [0-9.]+s.*?)"
                r"(?: =+)?$", log)  # fmt: skip
    summary = m[1] if m else "no summary line"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)
    if failed:
        shown = ", ".join(failed[:8]) + (f" and {len(failed) - 8} more" if len(failed) > 8 else "")
        summary += f"; failing: {shown}"
    return summary


def kernel_rows(log: str) -> tuple[list[str], list[list[str]]]:
    """The header lines (# ...) and the table rows' cells the kernel benchmark printed."""
    header = [line for line in log.splitlines() if line.startswith("# ")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in log.splitlines()
            if line.startswith(("| decode", "| mixed"))]  # fmt: skip
    return header, rows


def _percent(cell: str) -> float | None:
    return float(cell[:-1]) / 100 if cell.endswith("%") else None


def kernel_figures(log: str, copy_gbps: float | None) -> str:
    header, rows = kernel_rows(log)
    if not rows:
        return "no rows printed"
    kernels = sorted({r[1] for r in rows if len(r) > 1})
    text = f"{len({r[0] for r in rows})} cases x {', '.join(kernels)}"
    gone = [h[2:] for h in header if re.match(r"# \w+: unavailable|# \w+ failed on", h)]
    if gone:
        text += "; " + "; ".join(gone[:3]) + (f" (+{len(gone) - 3})" if len(gone) > 3 else "")
    best = max(rows, key=lambda r: float(r[3]) if len(r) > 3 else 0.0)
    frac = _percent(best[4]) if len(best) > 4 else None
    text += f"; best {best[3]} GB/s ({best[1]}, {best[0]})"
    if frac is not None:
        text += f": **{frac:.0%} of the datasheet**"
    if copy_gbps:
        text += f", **{float(best[3]) / copy_gbps:.0%} of the copy rate**"
    return text + "; table below"


def tune_rows(log: str) -> tuple[list[str], list[str]]:
    """The table (its header, then a row per configuration) and the "# best ..." lines the
    tuning sweep printed."""
    lines = log.splitlines()
    rows = [line for line in lines if line.startswith(("| kernel |", "| decode |", "| mixed |"))]
    return rows, [line for line in lines if line.startswith("# best ")]


def tune_figures(log: str) -> str:
    rows, best = tune_rows(log)
    if not rows:
        return "no rows printed"
    return f"{len(rows) - 1} configurations, {len(best)} cases; best per case below"


def kv_transfer_figures(log: str) -> str:
    """The best GB/s of each copy path (benchmarks/bench_kv_transfer.py's table)."""
    best: dict[str, float] = {}
    for path, gbs in re.findall(
        r"^\| ([^|]+?) \| \d+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|$", log, re.M
    ):
        best[path] = max(best.get(path, 0.0), float(gbs))
    return "; ".join(f"{p}: {g:g} GB/s" for p, g in best.items()) or "no table"


def compile_figures(log: str) -> str | None:
    m = _search(r"compiled (\d+) step shapes in ([0-9.]+) s", log)  # the engine core's log
    return f"compiled {m[1]} step shapes in {m[2]} s" if m else None


def decode_step(log: str) -> tuple[float, str] | None:
    """(the decode step in ms, its runs as printed) from bench_latency/throughput's line."""
    m = _search(rf"^Decode step: ({NUM}) ms(?: \(median of (\d+) runs: ([^;]*?) ms;)?", log)
    if not m:
        return None
    return float(m[1]), (f"median of {m[2]}: {m[3]}" if m[2] else "one run")


def latency_figures(log: str, copy_gbps: float | None) -> str:
    parts = []
    if m := _search(rf"^Avg latency: ({NUM}) seconds", log):
        parts.append(f"avg latency {float(m[1]):.3f} s")
    if (step := decode_step(log)) and (m := _search(rf"^Decode step: .*; ({NUM}) tokens/s", log)):
        parts.append(f"decode step {step[0]:.2f} ms ({step[1]} ms), {m[1]} tok/s")
    if roof := roofline_figures(log, copy_gbps):
        parts.append(roof)
    if compiled := compile_figures(log):
        parts.append(compiled)
    return "; ".join(parts) or "no figures printed"


def throughput_figures(log: str, copy_gbps: float | None) -> str:
    parts = []
    m = _search(rf"^Throughput: ({NUM}) requests/s, ({NUM}) total tokens/s, ({NUM}) output "
                r"tokens/s", log)  # fmt: skip
    if m:
        parts.append(f"{m[1]} req/s, {m[3]} output tok/s ({m[2]} total)")
    if m := _search(r"^Runs: (.*) s \(median of (\d+)\)", log):
        parts.append(f"median of {m[2]} runs: {m[1]} s")
    if step := decode_step(log):
        parts.append(f"decode step {step[0]:.2f} ms ({step[1]} ms)")
    if roof := roofline_figures(log, copy_gbps):
        parts.append(roof)
    if compiled := compile_figures(log):
        parts.append(compiled)
    return "; ".join(parts) or "no figures printed"


def hf_rows(log: str) -> dict[int, float]:
    """{batch: HF's decode step in ms} from bench_hf_peer.py's lines."""
    found = re.findall(rf"^HF peer: batch (\d+): decode step ({NUM}) ms", log, re.M)
    return {int(b): float(ms) for b, ms in found}


def hf_figures(log: str) -> str:
    rows = hf_rows(log)
    if not rows:
        return "no figures printed"
    return "; ".join(f"batch {b}: decode step {ms:.2f} ms" for b, ms in rows.items())


def trace_rows(log: str) -> tuple[str | None, list[str]]:
    """The `Trace summary:` line and the table after it (profile_decode.py --trace-dir)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Trace summary:"):
            table = []
            for row in lines[i + 1 :]:
                if not row.startswith("|"):
                    break
                table.append(row)
            return line, table
    return None, []


def profile_figures(log: str) -> str:
    title, table = trace_rows(log)
    if not title:
        return "no trace summary printed"
    cells = {r.strip("|").split("|")[0].strip(): r.strip("|").split("|") for r in table[2:]}
    shown = [
        f"{k} {v[1].strip()} ms ({v[2].strip()})"
        for k, v in cells.items()
        if k in ("attention", "matmul", "sampler", "elementwise", "gaps (device idle)")
    ]
    step = cells.get("step (first op to last)")
    return (f"step {step[1].strip()} ms traced: " if step else "") + ", ".join(shown)


def env_figures(env: dict) -> str:
    if not env:
        return "no env.json"
    bad = [f"{m}: {e}" for m, e in env.get("imports", {}).items() if e != "ok"]
    text = f"jax {env.get('jax', '?')} on {env.get('backend', '?')}, {env.get('device_kind', '?')}"
    if env.get("jax_error"):
        text += f"; jax failed: {env['jax_error']}"
    return text + (f"; imports failing: {'; '.join(bad)}" if bad else "; jaxserve imports")


def copy_figures(log: str, device: str) -> str:
    m = _search(rf"^Copy rate: ({NUM}) GB/s (.*)$", log)
    if not m:
        return "no figures printed"
    sheet = datasheet_gbps(device)
    text = f"**{float(m[1]):.0f} GB/s** {m[2]}"
    return text + (f"; {float(m[1]) / sheet:.0%} of the datasheet {sheet:.0f} GB/s" if sheet
                   else "; no datasheet figure for this device")  # fmt: skip


def figures(step: dict, log: str, env: dict, copy_gbps: float | None, device: str) -> str:
    name = step["name"]
    if step["status"].startswith(("skipped", "dropped")):
        return ""
    if name == "env":
        return env_figures(env)
    if name == "wheels":
        wheels = [w.rsplit("/", 1)[-1] for w in step["command"].split() if w.endswith(".whl")]
        names = ", ".join(" ".join(w.split("-")[:2]) for w in wheels)
        return f"{len(wheels)}: {names}"
    if name == "copy_rate":
        return copy_figures(log, device)
    if name.startswith("pytest"):
        return pytest_figures(log)
    if name.startswith("kernel"):
        return kernel_figures(log, copy_gbps)
    if name == "tune_kernel":
        return tune_figures(log)
    if name == "kv_transfer":
        return kv_transfer_figures(log)
    if tag := SUMMARY_TAGS.get(name):  # their summary lines
        lines = [line[len(tag) :] for line in log.splitlines() if line.startswith(tag)]
        return "; ".join(lines) if lines else "no summary printed"
    if name == "hf_peer":
        return hf_figures(log)
    if name.startswith("profile"):
        return profile_figures(log)
    if name.startswith(("latency", "moe_", "q8b_")):
        return latency_figures(log, copy_gbps)
    if name.startswith("throughput"):
        return throughput_figures(log, copy_gbps)
    return ""


def status_cell(step: dict) -> str:
    status = step["status"]
    if status == "ok":
        return "ok"
    if status == "timeout":
        return f"**timeout** (killed at {step['limit']} s)"
    if status == "failed":
        return f"**failed** (exit {step['rc']})"
    return status


# ------------------------------------------------------------------------- budget plan
def read_plan(work: Path) -> list[dict]:
    """WORK/plan.tsv: name, rank, kind (model / other), expected s, limit s, command."""
    plan = []
    path = work / "plan.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rank, kind, expected, limit, command = (line.split("\t") + [""] * 6)[:6]
            plan.append(dict(name=name, rank=int(rank), kind=kind, expected=int(expected),
                             limit=int(limit), command=command))  # fmt: skip
    return plan


def plan_step(plan: list[dict], done: dict[str, str], name: str, left: int,
              compile_s: int = 0) -> tuple[str, int | str]:  # fmt: skip
    """("run", its limit) or ("drop", why) for step `name` with `left` seconds to go.

    The steps not yet done (done: name -> status) are taken in rank order, each while its
    expected seconds fit in what the higher-ranked ones leave; the first model run still to
    go (none has run ok) is expected to compile, compile_s more. `name` runs if it is taken,
    its limit cut to the time the higher-ranked steps taken leave it."""
    pending = [p for p in plan if p["name"] not in done]
    me = next(p for p in pending if p["name"] == name)
    warm = any(p["kind"] == "model" and done.get(p["name"]) == "ok" for p in plan)
    first = None if warm else next((p["name"] for p in pending if p["kind"] == "model"), None)

    def extra(p: dict) -> int:
        return compile_s if p["name"] == first else 0

    budget, taken = left, []
    for p in sorted(pending, key=lambda p: p["rank"]):
        if p["expected"] + extra(p) <= budget:
            taken.append(p)
            budget -= p["expected"] + extra(p)
    higher = sum(p["expected"] + extra(p) for p in taken if p["rank"] < me["rank"])
    if me not in taken:
        return "drop", (f"no time (rank {me['rank']}: expected {me['expected'] + extra(me)} s; "
                        f"{left - higher} s of the {left} s left beside the higher-ranked steps "
                        "still to run)")  # fmt: skip
    return "run", min(me["limit"] + extra(me), left - higher)


def plan_main(work: Path, name: str, left: int) -> int:
    compile_s = int(read_kv(work / "plan.txt").get("compile_s", "0"))
    done = {s["name"]: s["status"] for s in read_steps(work)}
    decision, value = plan_step(read_plan(work), done, name, left, compile_s)
    print(f"{decision} {value}")
    return 0


# ------------------------------------------------------------------------ kernel choice
def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def kernel_choice(log: str) -> dict:
    """The faster kernel from the kernel table (see gpu_suite.sh's header)."""
    header, rows = kernel_rows(log)
    times: dict[str, dict[str, float]] = {}
    for r in rows:
        if len(r) > 2:
            times.setdefault(r[0], {})[r[1]] = float(r[2])
    speedup: dict[str, list[float]] = {"decode": [], "mixed": []}
    for case, t in times.items():
        if "triton" in t and "mosaic" in t and t["mosaic"] > 0:
            speedup["mixed" if case.startswith("mixed") else "decode"].append(
                t["triton"] / t["mosaic"]
            )
    medians = {c: _median(v) for c, v in speedup.items() if v}
    out: dict = dict(mosaic_speedup={c: round(v, 3) for c, v in medians.items()},
                     cases=sum(len(v) for v in speedup.values()))  # fmt: skip
    for c, v in medians.items():
        out[c] = "mosaic" if v > 1 else "triton"
    if len(medians) < 2:
        why = next((h[2:] for h in header if h.startswith("# mosaic")), "no mosaic rows")
        out.update(kernel="triton", reason=f"mosaic not measured on both classes: {why}")
        return out
    mean = (medians["decode"] * medians["mixed"]) ** 0.5
    out["kernel"] = "mosaic" if mean > 1 else "triton"
    out["reason"] = f"geometric mean of the decode and mixed median speed-ups {mean:.3f}"
    return out


def kernel_choice_main(work: Path, dest: Path) -> int:
    path = work / "kernel_bench.log"
    if not path.exists():
        print("kernel-choice: no kernel_bench.log", file=sys.stderr)
        return 1
    env = json.loads((work / "env.json").read_text()) if (work / "env.json").exists() else {}
    suite = read_kv(work / "suite.txt")
    choice = kernel_choice(path.read_text(errors="replace"))
    tests = next((s["status"] for s in read_steps(work) if s["name"] == "pytest_gpu"), "not run")
    if choice["kernel"] == "mosaic" and tests != "ok":  # measured, but not shown correct
        choice.update(kernel="triton", reason=f"the GPU tests (both kernels) were {tests} in "
                      f"this run; the Mosaic kernel was faster: {choice['reason']}")  # fmt: skip
    choice.update(commit=suite.get("commit", "unknown"), jax=env.get("jax", "?"),
                  date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"))  # fmt: skip
    table = {"format": 1, "devices": {}}
    if dest.exists():
        with contextlib.suppress(ValueError):
            table = json.loads(dest.read_text())
    table.setdefault("devices", {})[env.get("device_kind") or "unknown"] = choice
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(f"kernel choice: {choice['kernel']} ({choice['reason']}) -> {dest}")
    return 0


# ------------------------------------------------------------------------------- report
def _table_row(cells: list[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def hf_section(logs: dict[str, str]) -> list[str]:
    """jaxserve's decode step beside HF's at each batch HF ran, and the must-show ratio."""
    hf = hf_rows(logs.get("hf_peer", ""))
    if not hf:
        return []
    lines = [
        "",
        "## Decode step: jaxserve against HF transformers (same device, same run)",
        "",
        'HF: `generate(..., cache_implementation="static")` (its compiled decode), step '
        "= (latency(N tokens) - latency(1)) / (N - 1), both medians; jaxserve: "
        "bench_latency's median step.",
        "",
        "| batch | jaxserve ms | HF static ms | jaxserve speed-up |",
        "|---|---|---|---|",
    ]
    must = max(hf)
    verdict = f"no jaxserve step at batch {must} (latency_b{must} did not run)"
    for b in sorted(hf):
        step = decode_step(logs.get(f"latency_b{b}", ""))
        ratio = hf[b] / step[0] if step and step[0] > 0 else None
        lines.append(_table_row([b, f"{step[0]:.2f}" if step else "-", f"{hf[b]:.2f}",
                                 f"{ratio:.2f}x" if ratio else "-"]))  # fmt: skip
        if b == must and ratio:
            ok = "yes" if ratio >= 2 else "**NO**"
            verdict = f"jaxserve is {ratio:.2f}x HF at batch {must}: >= 2x? {ok}"
    return lines + ["", f"**Must-show**: {verdict}"]


# the steps whose key figures are their lines starting with these tags
SUMMARY_TAGS = {
    "moe_gmm": "# moe ",
    "sparse_mla": "# sparse ",
    "attn_agreement": "# agreement ",
    "layer_kernels": "# per layer ",
    "gemm_backends": "# gemm ",
}

# issue 67's must-show: the packed model's decode step over bf16's, at (format, batch)
PACKED_TARGETS = {("int4", 1): 2.0, ("int4", 32): 1.3, ("fp8_block", 1): 1.5}


def packed_section(logs: dict[str, str]) -> list[str]:
    """Each q8b_<format>_b<B> step's decode step beside latency_b<B>'s (bf16, same run)."""
    rows = []
    for name in sorted(logs):
        m = re.fullmatch(r"q8b_(\w+)_b(\d+)", name)
        if not m or not (packed := decode_step(logs[name])):
            continue
        fmt, b = m[1], int(m[2])
        bf16 = decode_step(logs.get(f"latency_b{b}", ""))
        ratio = bf16[0] / packed[0] if bf16 and packed[0] > 0 else None
        target = PACKED_TARGETS.get((fmt, b))
        verdict = "-" if not (ratio and target) else (
            f">= {target}x? " + ("yes" if ratio >= target else "**NO**"))  # fmt: skip
        rows.append(_table_row([fmt, b, f"{packed[0]:.2f}", f"{bf16[0]:.2f}" if bf16 else "-",
                                f"{ratio:.2f}x" if ratio else "-", verdict]))  # fmt: skip
    if not rows:
        return []
    return ["", "## Packed weights: decode step against bf16 (same model and run)", "",
            "| format | batch | packed ms | bf16 ms | speed-up | must-show |",
            "|---|---|---|---|---|---|", *rows]  # fmt: skip


def kernel_section(title: str, log: str, copy_gbps: float | None) -> list[str]:
    header, rows = kernel_rows(log)
    if not rows and not header:
        return []
    lines = ["", title, "", *header, ""]
    if copy_gbps:
        lines.append(f"of copy rate: KV GB/s / the measured {copy_gbps:.0f} GB/s copy rate.")
        lines.append("")
    lines += ["| case | kernel | kernel us | KV GB/s | of datasheet | of copy rate | "
              "vs XLA reference | vs jax Pallas decode | max abs err |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if len(r) < 8:
            continue
        of_copy = f"{float(r[3]) / copy_gbps:.0%}" if copy_gbps else "-"
        lines.append(_table_row([*r[:5], of_copy, *r[5:8]]))
    return lines


def budget_section(work: Path, steps: list[dict]) -> list[str]:
    plan = read_plan(work)
    if not plan:
        return []
    status = {s["name"]: s for s in steps}
    compile_s = read_kv(work / "plan.txt").get("compile_s", "0")
    lines = [
        "",
        "## Budget: the ranking and what was dropped",
        "",
        "Steps run in the order of the step table; before each, those still to run are "
        "planned in rank order at their expected seconds (the first model run "
        f"+{compile_s} s of compile) within the time left; what does not fit is dropped, "
        "lowest rank first.",
        "",
        "| rank | step | expected s | limit s | outcome |",
        "|---|---|---|---|---|",
    ]
    for p in sorted(plan, key=lambda p: p["rank"]):
        s = status.get(p["name"])
        outcome = status_cell(s) + (f" in {s['seconds']} s" if s and s["seconds"] != "0" else "") \
            if s else "not reached"  # fmt: skip
        lines.append(_table_row([p["rank"], p["name"], p["expected"], p["limit"], outcome]))
    dropped = [s["name"] for s in steps if s["status"].startswith("dropped")]
    lines += ["", f"Dropped: {', '.join(dropped) if dropped else 'none'}."]
    return lines


def build_report(work: Path) -> tuple[str, str]:
    """(file name, markdown)."""
    env = json.loads((work / "env.json").read_text()) if (work / "env.json").exists() else {}
    suite = read_kv(work / "suite.txt")
    steps = read_steps(work)
    device = device_name(env, suite)
    dry = suite.get("mode") == "dry-run"
    smi = env.get("nvidia_smi") or {}
    pk = env.get("packages", {})
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    logs = {}
    for s in steps:
        path = work / f"{s['name']}.log"
        logs[s["name"]] = path.read_text(errors="replace") if path.exists() else ""
    copy_gbps = copy_rate(work, logs.get("copy_rate", ""))
    counts: dict[str, int] = {}
    for s in steps:
        key = s["status"].split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    lines = []
    if suite.get("exact", "1") != "1":
        changed = suite.get("dirty") or ""
        lines += [f"**NOT AN EXACT COMMIT: {suite.get('commit', 'unknown')}"
                  + (f" with uncommitted changes to {changed.strip()}" if changed else "")
                  + ". These figures belong to no commit; the suite kept this report out of "
                  "benchmarks/results/.**", ""]  # fmt: skip
    lines += [f"# GPU suite: {device}", ""]
    lines.append(f"Written by `scripts/gpu_suite.sh` ({now})" + (
        ", **dry run on CPU**: smoke shapes and a tiny model, no figures to keep." if dry
        else "."))  # fmt: skip
    lines += ["", "| | |", "|---|---|"]
    dev = device
    if smi:
        dev += f" (driver {smi.get('driver', '?')}, {smi.get('memory', '?')})"
    if env.get("devices"):
        dev += f"; jax devices: {len(env['devices'])} x {env.get('device_kind', '?')}"
    lines.append(f"| device | {dev} |")
    jax_line = f"{env.get('jax', '?')} (jaxlib {pk.get('jaxlib', '?')}"
    plugin = pk.get("jax-cuda13-plugin") or pk.get("jax-cuda12-plugin")
    jax_line += f", cuda plugin {plugin})" if plugin else ")"
    lines.append(f"| jax | {jax_line}, backend {env.get('backend', '?')} |")
    others = ", ".join(f"{k} {v}" for k, v in pk.items() if not k.startswith("jax"))
    lines.append(f"| python | {env.get('python', '?')}; {others} |")
    commit = suite.get("commit", "unknown")
    if suite.get("dirty"):
        commit += f" **+ uncommitted changes** to {len(suite['dirty'].split())} tracked files"
    lines.append(f"| commit | {commit} |")
    sheet = datasheet_gbps(device)
    bandwidth = f"datasheet {sheet:.0f} GB/s" if sheet else "no datasheet figure"
    if copy_gbps:
        bandwidth += f"; measured copy rate {copy_gbps:.0f} GB/s" + (
            f" ({copy_gbps / sheet:.0%} of the datasheet)" if sheet else "")  # fmt: skip
    lines.append(f"| memory bandwidth | {bandwidth} |")
    done = ", ".join(f"{n} {k}" for k, n in counts.items())
    lines.append(f"| suite | {suite.get('elapsed', '?')} s of a {suite.get('budget', '?')} s "
                 f"budget; {len(steps)} steps: {done or 'none yet'} |")  # fmt: skip
    if suite.get("model_args"):
        lines.append(f"| model benchmarks | `{suite['model_args']}` |")
    ranks = {p["name"]: p["rank"] for p in read_plan(work)}
    lines += ["", "## Steps", "", "| step | rank | status | seconds | key figures |",
              "|---|---|---|---|---|"]  # fmt: skip
    for s in steps:
        cells = [s["name"], ranks.get(s["name"], 0), status_cell(s), s["seconds"],
                 figures(s, logs[s["name"]], env, copy_gbps, device)]  # fmt: skip
        lines.append(_table_row(cells))
    lines += hf_section(logs)
    lines += packed_section(logs)
    for s in steps:
        if s["name"].startswith("profile") and (trace := trace_rows(logs[s["name"]]))[0]:
            lines += ["", f"## Decode-step profile ({s['name']}, jax.profiler trace)", "",
                      trace[0], "", *trace[1]]  # fmt: skip
    for s in steps:
        if s["name"].startswith("kernel_bench") and logs.get(s["name"]):
            title = "## Paged-attention kernel" + (": MLA" if s["name"].endswith("mla") else "")
            lines += kernel_section(title, logs[s["name"]], copy_gbps)
    if logs.get("kernel_bench"):
        choice = kernel_choice(logs["kernel_bench"])
        lines += ["", "## Kernel choice (kernel_choice.json)", "",
                  f"{env.get('device_kind', device)}: **{choice['kernel']}** "
                  f"({choice['reason']}; median triton/mosaic time by class: "
                  f"{choice['mosaic_speedup'] or 'none'})"]  # fmt: skip
    rows, best = tune_rows(logs.get("tune_kernel", ""))
    if rows:
        lines += ["", "## Kernel tuning sweep", "", *[f"- {b[2:]}" for b in best], ""]
        lines += [rows[0], "|---" * rows[0].count(" | ") + "|---|", *rows[1:]]
    lines += budget_section(work, steps)
    lines += ["", "## Commands", ""]
    lines += [f"- {s['name']} (limit {s['limit']} s): `{s['command']}`" for s in steps
              if not s["status"].startswith("dropped")]  # fmt: skip
    bad = [s for s in steps if s["status"] in ("failed", "timeout")]
    if bad:
        lines += ["", "## Failures"]
        for s in bad:
            tail = logs[s["name"]].splitlines()[-FAILURE_TAIL:]
            lines += ["", f"### {s['name']} ({status_cell(s)})", "", "```", *tail, "```"]
    return f"gpu-{sanitise(device)}.md", "\n".join(lines) + "\n"


def write_report(work: Path, dests: list[Path]) -> None:
    name, text = build_report(work)
    previous = work / "report_name"
    for dest in dests:
        dest.mkdir(parents=True, exist_ok=True)
        if previous.exists() and previous.read_text() != name:  # the device became known
            (dest / previous.read_text()).unlink(missing_ok=True)
        (dest / name).write_text(text)
        print(dest / name)
    previous.write_text(name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "env":
        return collect_env(Path(argv[1]))
    if len(argv) >= 3 and argv[0] == "report":
        write_report(Path(argv[1]), [Path(d) for d in argv[2:]])
        return 0
    if len(argv) == 4 and argv[0] == "plan":
        return plan_main(Path(argv[1]), argv[2], int(argv[3]))
    if len(argv) == 3 and argv[0] == "kernel-choice":
        return kernel_choice_main(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
