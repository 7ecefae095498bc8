"""Where a traced decode step's device time goes, by op class, from a jax.profiler trace.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes, beside the .xplane.pb (which
needs xprof to read), `perfetto_trace.json.gz`: Chrome trace-event JSON, {"traceEvents": [...]}
with "M" events naming processes and threads and "X" events (ts and dur in microseconds, args).
The device's op events are:

- on a GPU, the X events of the device process ("/device:GPU:0") on its stream threads
  ("Stream #N(...)": the kernels and memcpys as they ran); where there are none, its "XLA Ops"
  thread;
- on the CPU (no device process), the host's X events that carry args.hlo_op (the thunks
  XLA:CPU runs, on its client and Eigen threads).

Each op is given one class by its names (the event's name, args.hlo_op, args.long_name) and its
module (args.hlo_module), first match in this order:

    sampler      its module is a sampling executable (jaxserve's `jit_sample_rows`: "sampl");
                 an op without a module, by name: sort, top_k, argmax, threefry, gumbel, ...
    attention    paged_attention, attention, attn, flash, fmha, sdpa, mha (Pallas kernels),
                 ffi_call (on the CPU, jaxserve's attention kernel is the forward's FFI call)
    matmul       gemm, gemv, dot, matmul, cublas, cutlass, nvjet, xmma, wgmma, ynn, onednn,
                 convolution, cudnn (not "convert": a dtype cast is elementwise)
    copy         memcpy, memset (transfers, not HLO copies)
    elementwise  the rest (fusions, reductions, norms, HLO copies, scatters)

XLA:CPU's control thunks (while, call, conditional) contain other ops' events and are left
out, so no time is counted twice.

Gaps are the device's idle time: the span from the first op's start to the last op's end,
less the union of every op's interval (idle between ops and between steps). Class times are
sums of durations; ops that overlap (CPU threads, GPU streams) can make them add up to more
than the busy time.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

CLASSES = ("attention", "matmul", "sampler", "elementwise", "copy")
_CONTAINER = re.compile(r"(?:while|call|conditional)(?:\.\d+)?")
_SAMPLER_MODULE = re.compile(r"sampl", re.I)
# an op without its module: a sampler's own ops by name
_SAMPLER_OPS = re.compile(r"(?<![a-z])sort|top_?k|argmax|threefry|philox|gumbel|categorical", re.I)
_PATTERNS = (
    ("attention", re.compile(r"paged_attention|attention|attn|flash|fmha|sdpa|(?<![a-z])mha|"
                             r"ffi_call", re.I)),
    ("matmul", re.compile(r"gemm|gemv|(?<![a-z])dot|matmul|cublas|cutlass|nvjet|xmma|wgmma|"
                          r"ynn|onednn|convolution|cudnn", re.I)),
    ("copy", re.compile(r"memcpy|memset", re.I)),
)  # fmt: skip


def classify(name: str, hlo_op: str = "", module: str = "", long_name: str = "") -> str:
    """The op class of one event (see the module docstring)."""
    text = " ".join((name, hlo_op, long_name))
    if _SAMPLER_MODULE.search(module) or (not module and _SAMPLER_OPS.search(text)):
        return "sampler"
    for cls, pattern in _PATTERNS:
        if pattern.search(text):
            return cls
    return "elementwise"


@dataclasses.dataclass
class TraceSummary:
    ops: int
    span_us: float  # first op's start to the last op's end
    busy_us: float  # the union of the ops' intervals
    class_us: dict[str, float]
    class_ops: dict[str, int]
    source: str  # which events were counted

    @property
    def gaps_us(self) -> float:
        return self.span_us - self.busy_us

    def table(self, steps: int = 1) -> list[str]:
        """Markdown rows: each class and the gaps in ms per step and as a share of the span."""
        rows = ["| op class | ms / step | of the step | ops / step |", "|---|---|---|---|"]
        span = self.span_us or 1.0
        for cls in CLASSES:
            us = self.class_us.get(cls, 0.0)
            rows.append(
                f"| {cls} | {us / 1e3 / steps:.3f} | {us / span:.0%} | "
                f"{self.class_ops.get(cls, 0) / steps:.0f} |"
            )
        rows.append(
            f"| gaps (device idle) | {self.gaps_us / 1e3 / steps:.3f} | "
            f"{self.gaps_us / span:.0%} | - |"
        )
        rows.append(
            f"| step (first op to last) | {self.span_us / 1e3 / steps:.3f} | 100% | "
            f"{self.ops / steps:.0f} |"
        )
        return rows


def load_events(path: str | Path) -> list[dict]:
    """The trace's events, from .json or .json.gz (a dict with traceEvents, or a list)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def device_ops(events: list[dict]) -> tuple[list[dict], str]:
    """The op events counted (see the module docstring) and a word on which they are."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    spans = [e for e in events if e.get("ph") == "X" and float(e.get("dur", 0)) > 0]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    on_device = [e for e in spans if e.get("pid") in devices]
    if on_device:
        for want in ("Stream", "XLA Ops"):
            picked = [
                e for e in on_device if threads.get((e["pid"], e.get("tid")), "").startswith(want)
            ]
            if picked:
                return picked, f"device {want} threads"
        return on_device, "device threads"
    host = [
        e
        for e in spans
        if "hlo_op" in e.get("args", {}) and _CONTAINER.fullmatch(str(e["args"]["hlo_op"])) is None
    ]
    return host, "host XLA ops"


def summarise_events(events: list[dict]) -> TraceSummary:
    ops, source = device_ops(events)
    class_us = dict.fromkeys(CLASSES, 0.0)
    class_ops = dict.fromkeys(CLASSES, 0)
    intervals = []
    for e in ops:
        args = e.get("args", {})
        cls = classify(
            str(e.get("name", "")),
            str(args.get("hlo_op", "")),
            str(args.get("hlo_module", "")),
            str(args.get("long_name", "")),
        )
        start, dur = float(e["ts"]), float(e["dur"])
        class_us[cls] += dur
        class_ops[cls] += 1
        intervals.append((start, start + dur))
    intervals.sort()
    busy, span = 0.0, 0.0
    if intervals:
        span = max(end for _, end in intervals) - intervals[0][0]
        cur_start, cur_end = intervals[0]
        for start, end in intervals[1:]:
            if start > cur_end:
                busy += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        busy += cur_end - cur_start
    return TraceSummary(len(ops), span, busy, class_us, class_ops, source)


def find_trace(directory: str | Path) -> Path | None:
    """The newest perfetto_trace.json.gz (else *.trace.json.gz) under a jax.profiler dir."""
    directory = Path(directory)
    for pattern in ("**/perfetto_trace.json.gz", "**/*.trace.json.gz"):
        found = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return None


def summarise(path: str | Path) -> TraceSummary:
    return summarise_events(load_events(path))
