"""Qwen3.5 and Qwen3-VL (each dense and MoE) with images (models/vlm.py): the vision tower's
output equals HF's `visual(...)` (Qwen3-VL's DeepStack features too), and through
`LLM.generate` the greedy tokens and prompt logprobs equal HF's (one image, and two of
different sizes) with interleaved M-RoPE (Qwen3.5: on its hybrid language model); a repeated
image prompt hits the prefix cache with the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.models.vision.qwen3_5_vision import Qwen3_5VisionEncoder
from tests.helpers import core_of, engines_in_process, runner_of
from tests.models.test_vlm import ENGINE, Family
from tests.models.test_vlm import test_greedy_tokens_and_logprobs_equal_hf as greedy_equals_hf
from tests.multimodal.tiny_vlm import draw_image, qwen3_5_processor


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"])
def qwen3_5(request, tmp_path_factory):
    fam = Family(request.param, tmp_path_factory)
    with engines_in_process():
        fam.llm = LLM(str(fam.dir), **ENGINE)
        yield fam


def test_vision_tower_equals_hf(qwen3_5):
    pix = qwen3_5_processor(qwen3_5.dir)(images=[draw_image(2, 50, 90)], return_tensors="np")
    grid = pix["image_grid_thw"]
    with torch.no_grad():
        want = qwen3_5.hf.model.visual(
            torch.tensor(pix["pixel_values"]), grid_thw=torch.tensor(grid)
        )
    want = np.concatenate(
        [
            want.pooler_output.numpy(),
            *(f.numpy() for f in getattr(want, "deepstack_features", None) or []),
        ],
        -1,
    )
    model = runner_of(qwen3_5.llm).model
    p = int(np.prod(grid, axis=1).sum())
    mm = model.config.hf_config.multimodal_config
    got = model.vision(**Qwen3_5VisionEncoder.prepare(mm, pix["pixel_values"], grid, p + 8))
    np.testing.assert_allclose(np.asarray(got)[: p // 4], want, atol=1e-4, rtol=0)


def test_greedy_tokens_and_logprobs_equal_hf(qwen3_5):
    greedy_equals_hf(qwen3_5)


def test_same_image_hits_the_prefix_cache(qwen3_5):
    """The same text + image again hits every full block (Qwen3.5: restoring the state kept
    at the last one) with the same tokens; another image hits the blocks before it, except on
    a hybrid model, which keeps states only at prompts' boundaries (0)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    text = "x" * 40 + qwen3_5.prompts[0]

    def run(seed: int):
        prompt = {"prompt": text, "multi_modal_data": {"image": draw_image(seed)}}
        return qwen3_5.llm.generate(prompt, params, use_tqdm=False)[0]

    first, again, other = run(7), run(7), run(8)
    full_blocks = (len(first.prompt_token_ids) - 1) // 16 * 16
    image_start = first.prompt_token_ids.index(qwen3_5.hf.config.image_token_id)
    before = 0 if qwen3_5.name.startswith("qwen3_5") else image_start // 16 * 16
    assert image_start < full_blocks
    assert (again.num_cached_tokens, other.num_cached_tokens) == (full_blocks, before)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_tp_2_with_preemption_equals_hf(name, tmp_path_factory):
    """Qwen3.5 (dense and MoE) with images at tp 2 (the linear attention's parameters and
    states split by heads) and a KV pool too small for both prompts at once: requests are
    preempted and recomputed (images encoded again, states rebuilt), with HF's greedy tokens
    and prompt logprobs."""
    fam = Family(name, tmp_path_factory)
    with engines_in_process():
        fam.llm = LLM(str(fam.dir), **{**ENGINE, "num_gpu_blocks_override": 6},
                      tensor_parallel_size=2)  # fmt: skip
        greedy_equals_hf(fam)
        scheduler = core_of(fam.llm).scheduler
        assert scheduler.total_preemptions > 0
        scheduler.kv_cache_manager.check_no_leaks()
        conv = runner_of(fam.llm).model.layers[0].linear_attn.conv1d
        assert tuple(conv[...].sharding.spec) == (None, "tp")
