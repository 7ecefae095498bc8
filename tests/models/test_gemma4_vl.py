"""Gemma 4 with images (models/vlm.py, models/vision/gemma4_vision.py): the vision tower's
output equals HF's `get_image_features` (images at their own aspect ratio, padded patches,
clipped linears, standardised features), and through `LLM.generate` the greedy tokens and
prompt logprobs equal HF's with one image and two of different sizes (an image's tokens
seeing each other both ways in the sliding layers only, per-layer embeddings of a pad token
for them, KV-sharing layers), chunked prefill at tp 1, and at tp 2 with preemption; the
same image prompt again hits the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM
from tests.helpers import core_of, engines_in_process, runner_of
from tests.models.test_vlm import ENGINE, Family
from tests.models.test_vlm import test_greedy_tokens_and_logprobs_equal_hf as greedy_equals_hf
from tests.models.test_vlm import test_same_image_hits_the_prefix_cache as same_image_hits
from tests.multimodal.tiny_vlm import draw_image, gemma4_processor

# an image is up to 70 tokens and runs in one step: a two-image prompt (~170 tokens) in chunks
GEMMA4_ENGINE = {**ENGINE, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    fam = Family("gemma4", tmp_path_factory)
    with engines_in_process():
        fam.llm = LLM(str(fam.dir), **GEMMA4_ENGINE)
        yield fam


def test_vision_tower_equals_hf(gemma4):
    pix = gemma4_processor(gemma4.dir)(images=[draw_image(2, 50, 90)], return_tensors="pt")
    with torch.no_grad():
        want = gemma4.hf.model.get_image_features(pix["pixel_values"], pix["image_position_ids"])
    want = want.pooler_output[0].numpy()
    positions = pix["image_position_ids"].numpy().astype(np.int32)
    got = runner_of(gemma4.llm).model.vision(pix["pixel_values"].numpy(), positions)
    assert got.shape[0] == 70 > len(want) == int(pix["num_soft_tokens_per_image"][0])
    np.testing.assert_allclose(np.asarray(got)[: len(want)], want, atol=1e-4, rtol=0)


def test_greedy_tokens_and_logprobs_equal_hf(gemma4):
    greedy_equals_hf(gemma4)


def test_tp_2_with_preemption_equals_hf(gemma4):
    """tp 2 (the full layers' one KV head repeated into each device's cache row, the vision
    tower split by heads and MLP units) and a KV pool
    too small for both prompts at once: requests are preempted and recomputed, their images
    encoded again, with HF's tokens and logprobs."""
    with engines_in_process():
        engine = {**GEMMA4_ENGINE, "num_gpu_blocks_override": 24}
        tight = LLM(str(gemma4.dir), **engine, tensor_parallel_size=2)
        greedy_equals_hf(_with_llm(gemma4, tight))
        tower = runner_of(tight).model.vision.layers[0]  # split by heads and MLP units
        assert tuple(tower.q_proj.linear.kernel[...].sharding.spec) == (None, "tp")
        assert tuple(tower.down_proj.linear.kernel[...].sharding.spec) == ("tp", None)
        assert core_of(tight).scheduler.total_preemptions > 0
        core_of(tight).scheduler.kv_cache_manager.check_no_leaks()


def _with_llm(fam: Family, llm: LLM) -> Family:
    clone = object.__new__(Family)
    clone.__dict__.update(fam.__dict__, llm=llm)
    return clone


def test_same_image_hits_the_prefix_cache(gemma4):
    same_image_hits(gemma4)
