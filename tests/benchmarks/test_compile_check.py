"""benchmarks/kernels/compile_check.py: its cases stay in step with the kernels' signatures
(each traces to its output shape here; compiling them needs jax >= 0.11's CUDA plugin, run by
hand before a GPU run)."""

from __future__ import annotations

import jax
import pytest

from benchmarks.kernels import compile_check


@pytest.mark.parametrize("group", sorted(compile_check.GROUPS))
def test_every_case_traces_to_its_output(group):
    cases = compile_check.GROUPS[group]()
    assert cases
    for name, (fn, args) in cases.items():
        out = jax.eval_shape(fn, *args)
        leaves = jax.tree.leaves(out)
        assert leaves and all(x.size > 0 for x in leaves), name
        if name.startswith("moe"):  # [rows, N] in the activations' dtype
            rows, n = args[0].shape[0], args[1].shape[2]
            assert (out.shape, out.dtype) == ((rows, n), args[0].dtype), name
        if name.startswith("attention"):  # q's shape
            assert out.shape == args[0].shape, name


def test_no_cuda_target_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(compile_check, "cuda_devices", lambda: ([], "no CUDA target (test)"))
    with pytest.raises(SystemExit, match="no CUDA target"):
        compile_check.main(["--only", "moe"])
