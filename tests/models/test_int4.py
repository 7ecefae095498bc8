"""4-bit weights kept packed (two a byte) and unpacked inside the step's matmul, from three
layouts, each checkpoint made by its own library (tests/data/quantized, by
scripts/make_quantized_checkpoints.py in the libraries' own venvs): compressed-tensors
pack-quantized W4A16, symmetric (group 32), asymmetric (group 64) and per channel, written by
llm-compressor; GPTQ (group 32, symmetric; group 64 asymmetric with desc_act; per channel with
desc_act) and AWQ gemm (group 64, zero points) written by GPTQModel. The reference of each is
its library's own dequantization: transformers' float32 logits of the checkpoint as
compressed-tensors decompresses it, or GPTQModel's (each QuantLinear's dequantized weight in a
float32 model), saved beside it by the same script."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config.quantization import CHECKPOINT_METHODS
from jaxserve.distributed.mesh import make_mesh
from jaxserve.entrypoints.cli import parse_args
from jaxserve.entrypoints.cli_args import engine_args_from
from jaxserve.models.loader import load_model
from tests.models.test_llama_parity import run_mixed_schedule

DATA = Path(__file__).resolve().parents[1] / "data" / "quantized"
# name -> the kernel's group: one scale per channel (group_size -1, strategy "channel") is
# kept in groups of 16 here (config.per_channel_group: inputs of 128 and 256, tp up to 8)
CHECKPOINTS = {"ct-w4a16-g32": 32, "ct-w4a16-asym-g64": 64, "ct-w4a16-channel": 16,
               "gptq-w4-g32": 32, "gptq-w4-asym-g64-actorder": 64,
               "gptq-w4-channel-actorder": 16, "awq-w4-g64": 64}  # fmt: skip


def prompts_and_reference(checkpoint: Path) -> tuple[list[list[int]], list[np.ndarray]]:
    prompts = json.loads((checkpoint / "reference_prompts.json").read_text())
    logits = np.load(checkpoint / "reference_logits.npz")
    return prompts, [logits[f"prompt_{i}"] for i in range(len(prompts))]


def assert_matches_recorded(loaded, checkpoint: Path) -> list[np.ndarray]:
    """The loaded model's logits over the checkpoint's recorded prompts (prefilled in a mixed
    schedule) are its recorded reference's within 1e-3 of their scale, with the same greedy
    tokens; returns them, a [len(prompt), V] array a prompt."""
    prompts, want = prompts_and_reference(checkpoint)
    _, got = run_mixed_schedule(loaded, prompts, decode_steps=0)
    rows = [got[i][: len(p)] for i, p in enumerate(prompts)]  # (a decode token follows some)
    for mine, ref in zip(rows, want, strict=True):
        np.testing.assert_allclose(mine, ref, atol=1e-3 * np.abs(ref).max(), rtol=0)
        assert (mine.argmax(-1) == ref.argmax(-1)).all()  # greedy: the same tokens
    return rows


def assert_generates_as_recorded(llm, checkpoint: Path) -> None:
    """The engine's greedy tokens of the checkpoint's recorded prompts (its
    reference_generate.json) equal the recorded ones and their logprobs are within 1e-2;
    the engine preempted requests on the way and leaked nothing."""
    from jaxserve.sampling_params import SamplingParams
    from tests.helpers import core_of

    ref = json.loads((checkpoint / "reference_generate.json").read_text())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ref["prompts"]], params, use_tqdm=False)
    for out, tokens, logprobs in zip(outs, ref["tokens"], ref["logprobs"], strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, tokens, strict=True)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-2)
    scheduler = core_of(llm).scheduler
    assert scheduler.total_preemptions > 0
    scheduler.kv_cache_manager.check_no_leaks()


def edited(checkpoint: Path, tmp_path: Path, edit) -> Path:
    """A copy of `checkpoint` whose quantization_config `edit(qc)` changes in place."""
    copy = tmp_path / f"edited-{checkpoint.name}"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def q_proj_columns(loaded, w: np.ndarray) -> np.ndarray:
    """Layer 0's q_proj [in, q] out of a weight [in, fused out] laid out as the qkv kernel:
    per KV head, its query heads, then its key and value (models/llama.py::fuse_qkv)."""
    c = loaded.config
    per_kv = w.shape[1] // c.num_kv_heads
    q_cols = c.num_heads // c.num_kv_heads * c.head_dim
    return np.concatenate([w[:, h * per_kv :][:, :q_cols] for h in range(c.num_kv_heads)], 1)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_logits_match_transformers_and_weights_stay_packed(name):
    loaded = load_model(DATA / name, dtype="float32")
    group = CHECKPOINTS[name]
    assert (loaded.config.quantization, loaded.config.quant_group) == ("int4", group)
    down = loaded.model.layers[0].mlp.down_proj  # 256 inputs -> 128 outputs
    assert down.kernel[...].dtype == jnp.uint8 and down.kernel[...].shape == (128, 128)
    assert down.scale[...].shape == down.offset[...].shape == (256 // group, 128)
    kernels = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    linears = [v.get_value() for p, v in nnx.to_flat_state(nnx.state(loaded.model))
               if p[-2] in kernels]  # fmt: skip
    as_fp32 = sum(8 * a.size for a in linears if a.dtype == jnp.uint8)  # 2 values a byte
    # half a byte a value, and a float32 scale and offset a group (act order: + perm)
    packed = sum(a.nbytes for a in linears if a.dtype != jnp.int32)
    assert packed == as_fp32 * (1 / 8 + 2 / group)
    assert_matches_recorded(loaded, DATA / name)


@pytest.mark.parametrize("name", ["gptq-w4-g32", "gptq-w4-channel-actorder", "awq-w4-g64"])
def test_unpacked_weights_equal_gptqmodels_dequantization(name):
    """Layer 0's q_proj, unpacked from the fused qkv kernel: GPTQModel's own dequantized
    weight (its QuantLinear's, saved as reference_dequant.npz [out, in])."""
    want = np.load(DATA / name / "reference_dequant.npz")["model.layers.0.self_attn.q_proj.weight"]
    loaded = load_model(DATA / name, dtype="float32")
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    k = np.asarray(qkv.kernel[...])
    u = np.stack([k & 0xF, k >> 4], axis=1).reshape(-1, k.shape[1]).astype(np.float32)
    group = CHECKPOINTS[name]
    rows = lambda a: np.repeat(np.asarray(a), group, axis=0)  # noqa: E731
    w = u * rows(qkv.scale[...]) + rows(qkv.offset[...])  # [in, fused out]
    if qkv.perm is not None:  # act order: kernel row r is input perm[r]
        w = w[np.argsort(np.asarray(qkv.perm[...]))]
    np.testing.assert_allclose(q_proj_columns(loaded, w).T, want, atol=1e-6, rtol=1e-6)


def test_the_engine_serves_it_with_transformers_greedy_tokens():
    """Through LLM (the engine core process, its config rebuilt there): greedy tokens of the
    prompts' next position are transformers'."""
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    prompts, want = prompts_and_reference(DATA / "ct-w4a16-asym-g64")
    llm = LLM(str(DATA / "ct-w4a16-asym-g64"), max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128)  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0, max_tokens=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids[0] for o in outs] == [int(r[-1].argmax()) for r in want]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "name", ["ct-w4a16-asym-g64", "gptq-w4-asym-g64-actorder", "ct-w4a16-channel"]
)
def test_tp2_equals_tp1(cpu_devices, name):
    """Row-parallel layers split whole groups; an act-order layer's input gather (its perm,
    over the whole input) is the same under tensor parallelism; so is a per-channel scale
    repeated over groups."""
    results = []
    for tp in (1, 2):
        mesh = make_mesh(tp, cpu_devices)
        loaded = load_model(DATA / name, dtype="float32", mesh=mesh)
        kernel = loaded.model.layers[0].self_attn.o_proj.kernel[...]  # row-parallel, packed
        assert kernel.sharding.shard_shape(kernel.shape) == (64 // tp, 128)
        prompts, _ = prompts_and_reference(DATA / name)
        results.append(run_mixed_schedule(loaded, prompts)[1])
    for seq in results[0]:
        np.testing.assert_allclose(results[1][seq], results[0][seq], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_bits": 3}, "int 3-bit packed weights are not supported"),
        ({"actorder": "group"}, "actorder 'group' is not supported"),
        ({"strategy": "tensor"}, "strategy 'tensor' is not supported for 4-bit weights"),
    ],
)
def test_unsupported_variants_are_named(tmp_path, change, message):
    bad = edited(DATA / "ct-w4a16-g32", tmp_path,
                 lambda qc: qc["config_groups"]["group_0"]["weights"].update(change))  # fmt: skip
    with pytest.raises(ValueError, match=message):
        load_model(bad, dtype="float32")


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("gptq-w4-g32", {"bits": 8}, "gptq checkpoint: bits 8 are not supported"),
        ("gptq-w4-g32", {"group_size": 0}, "group_size 0 is not supported"),
        ("gptq-w4-g32", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("awq-w4-g64", {"version": "gemv"}, "version 'gemv' is not supported"),
        ("awq-w4-g64", {"zero_point": False}, "zero_point false is not supported"),
    ],
)
def test_unsupported_gptq_and_awq_variants_are_named(tmp_path, name, change, message):
    bad = edited(DATA / name, tmp_path, lambda qc: qc.update(change))
    with pytest.raises(ValueError, match=message):
        load_model(bad, dtype="float32")


def test_act_order_layers_gather_their_input_by_group(tmp_path):
    """desc_act: each layer's rows sorted by g_idx, its input gathered by the same order (q,
    k and v share one, as they share one input); with one group per channel the order
    changes nothing and no gather is kept; a permuted g_idx without desc_act is refused,
    naming the tensor."""
    loaded = load_model(DATA / "gptq-w4-asym-g64-actorder", dtype="float32")
    assert loaded.config.quant_act_order
    perm = np.asarray(loaded.model.layers[0].self_attn.qkv_proj.perm[...])
    assert sorted(perm) == list(range(128)) and (perm != np.arange(128)).any()
    for name in ("gptq-w4-g32", "gptq-w4-channel-actorder"):
        plain = load_model(DATA / name, dtype="float32")
        assert plain.model.layers[0].mlp.down_proj.perm is None
    bad = edited(DATA / "gptq-w4-asym-g64-actorder", tmp_path,
                 lambda qc: qc.update(desc_act=False))  # fmt: skip
    with pytest.raises(ValueError, match=r"layers\.0\..*g_idx is not input row // group_size"):
        load_model(bad, dtype="float32")


def test_quantization_flag_names_the_checkpoints_own_method():
    """vLLM's --quantization gptq / gptq_marlin / awq / awq_marlin / compressed-tensors / mxfp4
    (every one a -q choice) select the checkpoint's own method, and name a mismatch (gpt-oss's
    mxfp4 served: test_gpt_oss.py)."""
    for flag in CHECKPOINT_METHODS:
        assert engine_args_from(parse_args(["serve", "m", "-q", flag])).quantization == flag
    for flag in ("gptq", "gptq_marlin"):
        assert load_model(DATA / "gptq-w4-g32", quantization=flag).config.quantization == "int4"
    with pytest.raises(ValueError, match="quantization 'awq': .* names 'gptq'"):
        load_model(DATA / "gptq-w4-g32", quantization="awq")
    with pytest.raises(ValueError, match="quantization 'mxfp4': .* names 'gptq'"):
        load_model(DATA / "gptq-w4-g32", quantization="mxfp4")
    with pytest.raises(ValueError, match="quantization 'gptq': .* names 'compressed-tensors'"):
        load_model(DATA / "ct-w4a16-g32", quantization="gptq")
