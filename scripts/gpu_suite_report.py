"""scripts/gpu_suite.sh's helper: `env` records the machine, `report` writes the markdown.

    python scripts/gpu_suite_report.py env WORK        # WORK/env.json (imports jax, jaxserve)
    python scripts/gpu_suite_report.py report WORK DIR [DIR ...]   # DIR/gpu-<device>.md

The report reads what the suite left in WORK: steps.tsv (one line per step: name, status,
exit code, seconds, limit, command), each step's log (NAME.log), env.json and suite.txt (mode,
budget, commit). Figures are parsed from the logs, the lines the benchmarks print, so a step
cut off by its time limit still reports what it printed. `report` imports nothing heavy: the
suite calls it after every step, so a suite killed midway still leaves a report.
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
KERNEL_HEADER = ("| case | kernel us | KV GB/s | of peak | vs XLA reference | vs jax Pallas decode "
                 "| max abs err |")  # fmt: skip


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


def roofline_figures(log: str) -> str | None:
    m = _search(rf"^Roofline: step ({NUM}) ms, memory bound ({NUM}) ms \(({NUM}) of it\)", log)
    if not m:
        return None
    return f"**{float(m[3]):.0%} of the HBM bound** (memory bound {m[2]} ms / step)"


def pytest_figures(log: str) -> str:
    m = _search(r"^=* ?(\d+ (?:passed|failed|skipped|deselected|errors?)\b.* in [0-9.]+s.*?)"
                r"(?: =+)?$", log)  # fmt: skip
    summary = m[1] if m else "no summary line"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)
    if failed:
        shown = ", ".join(failed[:8]) + (f" and {len(failed) - 8} more" if len(failed) > 8 else "")
        summary += f"; failing: {shown}"
    return summary


def kernel_rows(log: str) -> tuple[list[str], list[str]]:
    """The header lines (# ...) and table rows the kernel benchmark printed."""
    header = [line for line in log.splitlines() if line.startswith("# ")]
    rows = [line for line in log.splitlines()
            if line.startswith("| decode") or line.startswith("| mixed")]  # fmt: skip
    return header, rows


def kernel_figures(log: str) -> str:
    _, rows = kernel_rows(log)
    if not rows:
        return "no rows printed"
    best, best_case = None, None
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) > 3 and cells[3].endswith("%"):
            frac = float(cells[3][:-1]) / 100
            if best is None or frac > best:
                best, best_case = frac, cells[0]
    text = f"{len(rows)} cases"
    if best is None:
        return text + "; HBM peak unknown for this device: no fraction"
    return text + f"; best **{best:.0%} of the HBM peak** ({best_case}); table below"


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


def latency_figures(log: str) -> str:
    parts = []
    if m := _search(rf"^Avg latency: ({NUM}) seconds", log):
        parts.append(f"avg latency {float(m[1]):.3f} s")
    if m := _search(rf"^Decode step: ({NUM}) ms .*; ({NUM}) tokens/s", log):
        parts.append(f"decode step {m[1]} ms, {m[2]} tok/s")
    if roof := roofline_figures(log):
        parts.append(roof)
    if compiled := compile_figures(log):
        parts.append(compiled)
    return "; ".join(parts) or "no figures printed"


def throughput_figures(log: str) -> str:
    parts = []
    m = _search(rf"^Throughput: ({NUM}) requests/s, ({NUM}) total tokens/s, ({NUM}) output "
                r"tokens/s", log)  # fmt: skip
    if m:
        parts.append(f"{m[1]} req/s, {m[3]} output tok/s ({m[2]} total)")
    if m := _search(rf"^Decode step: ({NUM}) ms", log):
        parts.append(f"decode step {m[1]} ms")
    if roof := roofline_figures(log):
        parts.append(roof)
    if compiled := compile_figures(log):
        parts.append(compiled)
    return "; ".join(parts) or "no figures printed"


def env_figures(env: dict) -> str:
    if not env:
        return "no env.json"
    bad = [f"{m}: {e}" for m, e in env.get("imports", {}).items() if e != "ok"]
    text = f"jax {env.get('jax', '?')} on {env.get('backend', '?')}, {env.get('device_kind', '?')}"
    if env.get("jax_error"):
        text += f"; jax failed: {env['jax_error']}"
    return text + (f"; imports failing: {'; '.join(bad)}" if bad else "; jaxserve imports")


def figures(step: dict, log: str, env: dict) -> str:
    name = step["name"]
    if step["status"].startswith("skipped"):
        return ""
    if name == "env":
        return env_figures(env)
    if name == "wheels":
        wheels = [w.rsplit("/", 1)[-1] for w in step["command"].split() if w.endswith(".whl")]
        names = ", ".join(" ".join(w.split("-")[:2]) for w in wheels)
        return f"{len(wheels)}: {names}"
    if name.startswith("pytest"):
        return pytest_figures(log)
    if name.startswith("kernel"):
        return kernel_figures(log)
    if name == "tune_kernel":
        return tune_figures(log)
    if name == "kv_transfer":
        return kv_transfer_figures(log)
    if name.startswith("latency"):
        return latency_figures(log)
    if name.startswith("throughput"):
        return throughput_figures(log)
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
    counts: dict[str, int] = {}
    for s in steps:
        key = s["status"].split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    lines = [f"# GPU suite: {device}", ""]
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
    lines.append(f"| commit | {suite.get('commit', 'unknown')} |")
    done = ", ".join(f"{n} {k}" for k, n in counts.items())
    lines.append(f"| suite | {suite.get('elapsed', '?')} s of a {suite.get('budget', '?')} s "
                 f"budget; {len(steps)} steps: {done or 'none yet'} |")  # fmt: skip
    if suite.get("model_args"):
        lines.append(f"| model benchmarks | `{suite['model_args']}` |")
    lines += ["", "## Steps", "", "| step | status | seconds | key figures |", "|---|---|---|---|"]
    logs = {}
    for s in steps:
        path = work / f"{s['name']}.log"
        logs[s["name"]] = path.read_text(errors="replace") if path.exists() else ""
        cells = [s["name"], status_cell(s), s["seconds"], figures(s, logs[s["name"]], env)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    kernel = [s for s in steps if s["name"].startswith("kernel") and logs.get(s["name"])]
    for s in kernel:
        header, rows = kernel_rows(logs[s["name"]])
        if rows:
            title = "## Paged-attention kernel" + (": MLA" if s["name"].endswith("mla") else "")
            lines += ["", title, "", *header, ""]
            lines += [KERNEL_HEADER, "|---|---|---|---|---|---|---|", *rows]
    rows, best = tune_rows(logs.get("tune_kernel", ""))
    if rows:
        lines += ["", "## Kernel tuning sweep", "", *[f"- {b[2:]}" for b in best], ""]
        lines += [rows[0], "|---" * rows[0].count(" | ") + "|---|", *rows[1:]]
    lines += ["", "## Commands", ""]
    lines += [f"- {s['name']} (limit {s['limit']} s): `{s['command']}`" for s in steps]
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
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
