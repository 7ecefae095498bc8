"""The roofline's arithmetic, its printed line and the GPU datasheet table."""

import re

import jax.numpy as jnp
import pytest

from jaxserve.benchmarks.roofline import (
    DevicePeaks,
    Roofline,
    StepCost,
    datasheet_peaks,
    decode_step_cost,
    param_counts,
)
from jaxserve.config import ModelConfig, RopeConfig


def tiny_config(tie: bool, dtype=jnp.float32) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-5,
        rope=RopeConfig(), max_position_embeddings=64, tie_word_embeddings=tie, dtype=dtype,
    )  # fmt: skip


@pytest.mark.parametrize("tie", [True, False])
def test_param_counts_and_step_cost(tie):
    c = tiny_config(tie)
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16 + 2 * 8  # q, k+v, o, mlp, two norms
    embed = 100 * 8
    total = embed + 2 * per_layer + 8 + (0 if tie else embed)
    assert param_counts(c) == (total, total - 2 * 2 * 8 - 8 - (0 if tie else embed), 0)
    cost = decode_step_cost(c, [10, 20, 30])  # 3 sequences, 60 cached tokens in all
    # tied: the LM head reads the table whole; untied: the lookup reads 3 of its 100 rows
    # (the LM head, its own table, whole)
    assert cost.weight_bytes == 4 * (total if tie else total - embed + 3 * 8)
    assert cost.kv_bytes == 2 * 2 * 2 * 2 * 4 * 60  # K and V, L, Hkv, hd, fp32 bytes, tokens
    matmul = param_counts(c)[1]
    assert cost.flops == 2 * matmul * 3 + 4 * 2 * 4 * 2 * 60
    half = decode_step_cost(tiny_config(tie, jnp.bfloat16), [10, 20, 30])
    assert half.weight_bytes * 2 == cost.weight_bytes and half.kv_bytes * 2 == cost.kv_bytes


def test_an_untied_embedding_is_read_a_row_a_sequence_at_most_whole():
    """The lookup reads B rows of hidden_size, never more than the table; tied, the table
    counts whole (the LM head reads it) whatever B."""
    untied, tied = tiny_config(False), tiny_config(True)
    head_and_rest = param_counts(untied)[0] - 100 * 8
    for b, rows in ((1, 1), (64, 64), (150, 100)):
        assert decode_step_cost(untied, [5] * b).weight_bytes == 4 * (head_and_rest + rows * 8)
        assert decode_step_cost(tied, [5] * b).weight_bytes == 4 * param_counts(tied)[0]


def test_a_mixture_of_experts_reads_the_experts_its_rows_pick():
    """E = 8 experts, k = 2 per row: one row reads 2 of each layer's 8, four rows an
    expected 8 * (1 - (3/4) ** 4); each row multiplies through 2."""
    import dataclasses

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    c = dataclasses.replace(tiny_config(True), architecture="MixtralForCausalLM", **moe)
    total, matmul, experts = param_counts(c)
    assert experts == 2 * 8 * 3 * 8 * 16  # layers, experts, gate + up + down, D x F
    one, four = decode_step_cost(c, [1]), decode_step_cost(c, [1] * 4)
    assert one.weight_bytes == int(4 * (total - experts + experts * 2 / 8))
    assert four.weight_bytes == int(4 * (total - experts + experts * (1 - 0.75**4)))
    assert one.flops == pytest.approx(2 * (matmul - experts + experts / 4) + 4 * 2 * 4 * 2)


def test_roofline_line_gives_each_bound_as_a_fraction_of_the_step():
    peaks = DevicePeaks("dev", bandwidth=1e9, flops=1e12, how="test")
    r = Roofline(0.020, StepCost(weight_bytes=10_000_000, kv_bytes=0.0, flops=2e9), peaks)
    assert r.line() == (
        "Roofline: step 20.00 ms, memory bound 10.00 ms (0.50 of it), "
        "compute bound 2.00 ms (0.10 of it)"
    )
    assert re.search(r"9\.5 MiB of weights .* dev: 1\.0 GB/s, 1000 GFLOP/s \(test\)", r.detail())
    d = r.to_dict()
    assert d["memory_fraction"] == pytest.approx(0.5) and d["compute_bound_ms"] == pytest.approx(2)


def test_gpu_peaks_come_from_the_datasheet_table():
    h100 = datasheet_peaks("NVIDIA H100 80GB HBM3", jnp.bfloat16)
    assert (h100.bandwidth, h100.flops, h100.how) == (3.35e12, 989e12, "datasheet")
    assert datasheet_peaks("NVIDIA H200", jnp.bfloat16).bandwidth == 4.8e12
    assert datasheet_peaks("NVIDIA H100 PCIe", jnp.bfloat16).bandwidth == 2.0e12
    assert datasheet_peaks("NVIDIA H100 80GB HBM3", jnp.float32).flops == 67e12
    assert datasheet_peaks("cpu", jnp.float32) is None
