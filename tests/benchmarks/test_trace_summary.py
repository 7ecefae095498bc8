"""jaxserve/benchmarks/trace_summary.py on small synthetic traces: which events count, the op
classes by name, the gaps, and the perfetto file as jax.profiler writes it."""

from __future__ import annotations

import gzip
import json

import pytest

from jaxserve.benchmarks.trace_summary import classify, find_trace, summarise, summarise_events


@pytest.mark.parametrize(
    ("name", "hlo_op", "module", "long_name", "want"),
    [
        ("ragged_paged_attention_decode", "custom-call.12", "jit_forward", "", "attention"),
        ("mosaic_gpu_flash_kernel", "", "jit_forward", "", "attention"),
        ("ffi_call.3", "ffi_call.3", "jit_forward", "", "attention"),  # the CPU kernel
        ("nvjet_tst_128x64_64x4_2x1_v_bz_TNT", "custom-call.4", "jit_forward", "", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "", "", "", "matmul"),
        ("gemm_fusion_dot.45", "gemm_fusion_dot.45", "jit_forward", "", "matmul"),
        ("custom-call.7", "custom-call.7", "jit_forward", "__cublas$gemm", "matmul"),
        ("ynn_fusion", "ynn_fusion", "jit_forward", "", "matmul"),  # XLA:CPU's dots
        ("loop_convert_fusion", "loop_convert_fusion", "jit_forward", "", "elementwise"),
        ("input_reduce_fusion.2", "", "jit_forward", "", "elementwise"),
        ("copy.113", "copy.113", "jit_forward", "", "elementwise"),  # an HLO copy
        ("MemcpyD2H", "", "", "", "copy"),
        ("Memset", "", "", "", "copy"),
        # the sampler's module decides, whatever its ops are called
        ("gemm_fusion_dot.1", "gemm_fusion_dot.1", "jit_sample_rows", "", "sampler"),
        ("loop_add_fusion", "loop_add_fusion", "jit_sample_rows", "", "sampler"),
        # no module: a sampler's own ops by name; in the forward, a sort is not sampling
        ("sort.3", "", "", "", "sampler"),
        ("sort.3", "sort.3", "jit_forward", "", "elementwise"),
    ],
)  # fmt: skip
def test_ops_are_classified_by_name_and_module(name, hlo_op, module, long_name, want):
    assert classify(name, hlo_op, module, long_name) == want


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _op(pid, tid, ts, dur, name, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def gpu_trace() -> list[dict]:
    """Two decode steps on a GPU: stream kernels (what counts), their XLA Ops copies (ignored
    when streams exist), host events (ignored: a device process is there)."""
    fwd, smp = "jit_forward", "jit_sample_rows"
    events = [_meta(1, "/host:CPU"), _meta(1, "python", 10), _meta(2, "/device:GPU:0"),
              _meta(2, "Stream #13(Compute)", 20), _meta(2, "Stream #14(MemcpyD2H)", 21),
              _meta(2, "XLA Ops", 22)]  # fmt: skip
    for t0 in (0.0, 100.0):  # steps at 0 and 100 us; 20 us idle between them
        events += [
            _op(2, 20, t0 + 0, 30, "nvjet_tst_gemm", hlo_op="custom-call.1", hlo_module=fwd),
            _op(2, 20, t0 + 32, 20, "ragged_paged_attention_decode", hlo_module=fwd),
            _op(2, 20, t0 + 52, 8, "loop_add_fusion", hlo_op="fusion.3", hlo_module=fwd),
            _op(2, 20, t0 + 65, 10, "input_reduce_fusion", hlo_op="fusion.9", hlo_module=smp),
            _op(2, 21, t0 + 76, 4, "MemcpyD2H"),
            _op(2, 22, t0 + 0, 60, "fusion.3", hlo_op="fusion.3", hlo_module=fwd),  # XLA Ops
            _op(1, 10, t0 + 0, 80, "dot", hlo_op="dot.1", hlo_module=fwd),  # host
        ]
    events.append(_op(2, 20, 150.0, 0, "zero-length marker"))  # no duration: not an op
    return events


def test_a_gpu_trace_counts_the_stream_kernels_and_the_idle_time_between_them():
    s = summarise_events(gpu_trace())
    assert s.source == "device Stream threads" and s.ops == 10
    assert s.class_us == {"matmul": 60, "attention": 40, "elementwise": 16, "sampler": 20,
                          "copy": 8}  # fmt: skip
    assert s.span_us == 180  # 0 to 100 + 80
    # busy per step: 0-30, 32-52, 52-60, 65-75, 76-80 = 72 us; idle: 2 + 5 + 1 in each step
    # and 20 between the steps
    assert s.busy_us == 144 and s.gaps_us == 36
    table = s.table(steps=2)
    assert table[0] == "| op class | ms / step | of the step | ops / step |"
    assert "| matmul | 0.030 | 33% | 1 |" in table
    assert "| gaps (device idle) | 0.018 | 20% | - |" in table
    assert table[-1] == "| step (first op to last) | 0.090 | 100% | 5 |"


def test_without_streams_the_xla_ops_line_counts():
    events = [e for e in gpu_trace() if e.get("tid") not in (20, 21)]
    s = summarise_events(events)
    assert s.source == "device XLA Ops threads" and s.ops == 2
    assert s.class_us["elementwise"] == 120 and s.gaps_us == 40  # 60-100 idle


def test_a_cpu_trace_counts_host_xla_ops_but_not_control_thunks():
    """XLA:CPU: no device process; the thunks with hlo_op count, a `while` or `call` that
    holds others does not (its time is theirs), nor Python or runtime events."""
    events = [_meta(7, "/host:CPU"), _meta(7, "tf_XLAEigen/1", 3)]
    events += [
        _op(7, 3, 0, 50, "while.2", hlo_op="while.2", hlo_module="jit_forward"),
        _op(7, 3, 1, 10, "ynn_fusion", hlo_op="ynn_fusion", hlo_module="jit_forward"),
        _op(7, 3, 12, 6, "ffi_call", hlo_op="ffi_call", hlo_module="jit_forward"),
        _op(7, 3, 20, 4, "call", hlo_op="call", hlo_module="jit_forward"),
        _op(7, 3, 30, 5, "add_fusion", hlo_op="add_fusion", hlo_module="jit_sample_rows"),
        _op(7, 3, 0, 40, "ThunkExecutor::Execute"),
        _op(7, 3, 40, 1, "end: add_fusion"),
    ]  # fmt: skip
    s = summarise_events(events)
    assert s.source == "host XLA ops" and s.ops == 3
    assert (s.class_us["matmul"], s.class_us["attention"], s.class_us["sampler"]) == (10, 6, 5)
    assert s.span_us == 34 and s.busy_us == 21


def test_the_perfetto_file_is_found_and_read(tmp_path):
    run = tmp_path / "plugins" / "profile" / "2026_11_27_12_00_00"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": gpu_trace()}, f)
    (run / "host.xplane.pb").write_bytes(b"\0")
    path = find_trace(tmp_path)
    assert path == run / "perfetto_trace.json.gz"
    assert summarise(path).ops == 10
    assert find_trace(tmp_path / "plugins" / "none") is None
