"""The kernels a forward launches, counted from optimized HLO (jaxserve/benchmarks/kernel_count.py):
the HLO reading here, and on a GPU (the GPU suite's pytest_gpu) the 8B decode forward's
kernels per layer against issue 68's bound."""

from __future__ import annotations

import collections

import pytest

from jaxserve.benchmarks import kernel_count
from jaxserve.benchmarks.kernel_count import count, count_per_layer, entry_kernels
from jaxserve.engine.arg_utils import EngineArgs
from tests.helpers import make_tiny_hf

# An optimized GPU module's entry, cut down: one of each kind of instruction.
HLO = """HloModule jit_forward, entry_computation_layout={...}

%fused_add (p0: bf16[8], p1: bf16[8]) -> bf16[8] {
  ROOT %add = bf16[8]{0} add(%p0, %p1)
}

%dynamic-slice-fusion (p0: s32[2,8], p1: bf16[8,8]) -> bf16[8,8] {
  %p0 = s32[2,8]{1,0} parameter(0)
  %slice = s32[1,8]{1,0} slice(%p0), slice={[1:2], [0:8]}
  ROOT %mpmd_map.8 = bf16[8,8]{1,0} custom-call(%slice, %p1), custom_call_target="mosaic_gpu_v2"
}

ENTRY %main.41 (a: bf16[8,8], b: bf16[8]) -> (bf16[8], s32[]) {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8]{0} parameter(1)
  %constant_1 = s32[] constant(0)
  %bitcast.1 = bf16[64]{0} bitcast(%a)
  %gemm_fusion_dot = f32[2,8,8]{2,1,0} fusion(%a, %a), kind=kCustom, calls=%gemm_fusion_dot_c
  %cublas = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm"
  %mpmd_map.2 = bf16[8,8]{1,0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  %triton = bf16[8,8]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  %dynamic_slice_fusion = bf16[8,8]{1,0} fusion(%i, %a), kind=kCustom, calls=%dynamic-slice-fusion
  %loop_add_fusion = bf16[8]{0} fusion(%b, %b), kind=kLoop, calls=%fused_add
  %tuple.1 = (s32[], bf16[8]{0}) tuple(%constant_1, %b)
  %while.3 = (s32[], bf16[8]{0}) while(%tuple.1), condition=%cond, body=%body
  %get-tuple-element.2 = s32[] get-tuple-element(%while.3), index=0
  %copy.1 = bf16[8]{0} copy(%loop_add_fusion)
  ROOT %tuple.2 = (bf16[8]{0}, s32[]) tuple(%copy.1, %get-tuple-element.2)
}
"""


def test_entry_kernels_are_the_launches_by_class():
    kernels = entry_kernels(HLO)
    assert [name for _, name in kernels] == [
        "%gemm_fusion_dot f32[2,8,8]",
        "%cublas (bf16[8,8], s8[0])",
        "%mpmd_map.2 bf16[8,8]",
        "%triton bf16[8,8]",
        "%dynamic_slice_fusion bf16[8,8]",
        "%loop_add_fusion bf16[8]",
        "%while.3 (s32[], bf16[8])",
        "%copy.1 bf16[8]",
    ]  # each with its type, layouts left out (a split-K GEMM's f32 partials show)
    # the Pallas call XLA wrapped in a dynamic_slice_fusion (its operand's slice) is one
    assert count(HLO) == collections.Counter(gemm=2, pallas=3, elementwise=2, control=1)


@pytest.mark.gpu
def test_8b_decode_layer_launches_few_kernels():
    """Issue 68: the 8B decode forward at 256 tokens, one decoder layer's kernels: the four
    GEMMs, the attention, and at most MAX_ELEMENTWISE others (compiled for an H100 with no
    device on 2026-12-06: 10 before, 8 with the Mosaic kernel's direct decode path, 7 with
    the RMSNorm folded into the next projection's output rows;
    benchmarks/results/layer-kernels-h100-deviceless-2026-12-06.md)."""
    args = EngineArgs(
        model="llama-3-8b", load_format="dummy", dtype="bfloat16", max_model_len=512,
        max_num_seqs=256, attention_backend="pallas",
    )  # fmt: skip
    result = count_per_layer(args, layers=3, tokens=256, decode_only=True)
    assert result.per_layer["gemm"] == 4, result.line()
    assert result.per_layer["pallas"] == 1, result.line()
    assert result.per_layer["elementwise"] <= MAX_ELEMENTWISE, result.line()


MAX_ELEMENTWISE = 7


def test_count_per_layer_runs_on_todays_runner(tmp_path, monkeypatch):
    """The forward built and compiled as the runner builds it (here for XLA:CPU: no CUDA
    target: XLA:CPU's dots are library fusions, counted as elementwise), a layer told
    apart."""
    monkeypatch.setattr(kernel_count, "cuda_devices", lambda: ([], "no CUDA here"))
    with pytest.raises(RuntimeError, match="no CUDA here"):
        count_per_layer(EngineArgs(model="x"), layers=3, tokens=4, decode_only=False)
    model = make_tiny_hf("llama", tmp_path, hidden_size=64, intermediate_size=128)
    args = EngineArgs(
        model=str(model), load_format="dummy", dtype="float32", max_model_len=32,
        max_num_seqs=4, max_num_batched_tokens=16, attention_backend="reference",
    )  # fmt: skip
    result = count_per_layer(args, layers=3, tokens=4, decode_only=False, cpu_ok=True)
    assert result.how.startswith("cpu: no CUDA target")
    added = sum(result.per_layer.values())
    assert 0 < added < sum(result.total.values())
