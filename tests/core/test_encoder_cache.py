"""The scheduler's image work (core/encoder_cache_manager.py): which encoder inputs each step
runs, under the encoder budget and the cache's rows; shared and reused images; bidirectional
images never split; preemption and abort give the rows back."""

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.encoder_cache_manager import EncoderCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import ModelRunnerOutput
from jaxserve.multimodal.inputs import MultiModalFeature
from jaxserve.sampling_params import SamplingParams

BS = 4
IMG = 99  # the placeholder token


def make(rows=32, budget=32, max_tokens=32, bidirectional=False, num_blocks=128, **cache):
    ec = EncoderCacheManager(rows, budget, bidirectional=bidirectional)
    sched = Scheduler(
        SchedulerConfig(512, max_num_seqs=8, max_num_batched_tokens=max_tokens),
        CacheConfig(block_size=BS, **cache), num_blocks, encoder_cache=ec,
    )  # fmt: skip
    return sched, ec


def image_request(req_id, images, *, text=6, gap=3, max_tokens=2):
    """text tokens, then per image (identifier, length) its placeholders and `gap` tokens."""
    ids, feats = list(range(1, text + 1)), []
    for ident, length in images:
        feats.append(MultiModalFeature("image", ident, len(ids), length, {}))
        ids += [IMG] * length + [5] * gap
    return Request(req_id, ids, SamplingParams(max_tokens=max_tokens), eos_token_id=None,
                   block_size=BS, mm_features=feats)  # fmt: skip


def step(sched):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(ids, np.full(len(ids), 7, np.int32)))
    return out


def encoded(out) -> dict:
    return {r: list(v) for r, v in out.scheduled_encoder_inputs.items()}


def test_images_encoded_in_the_step_that_reaches_them():
    """A prompt chunked by the token budget: each image is encoded in the step whose tokens
    first reach it, and the step lists the rows of every image its tokens read."""
    sched, ec = make(max_tokens=12)
    r = image_request("a", [("img1", 8), ("img2", 8)])  # image 1 at 6..13, image 2 at 17..24
    sched.add_request(r)
    out = step(sched)  # tokens 0..11
    assert encoded(out) == {"a": [0]} and set(out.encoder_rows) == {"img1"}
    assert len(out.encoder_rows["img1"]) == 8
    out = step(sched)  # tokens 12..23: the rest of image 1, image 2
    assert encoded(out) == {"a": [1]} and set(out.encoder_rows) == {"img1", "img2"}
    out = step(sched)
    assert not out.scheduled_encoder_inputs
    while sched.has_unfinished_requests():
        step(sched)
    assert set(ec.unused) == {"img1", "img2"} and not ec.users  # kept for reuse, unused


def test_encoder_budget_cuts_the_tokens_before_an_image():
    """Two 8-token images and an encoder budget of 8 a step: the step stops before the
    second image, which runs the next step."""
    sched, _ = make(budget=8, max_tokens=64)
    sched.add_request(image_request("a", [("img1", 8), ("img2", 8)]))
    out = step(sched)
    assert encoded(out) == {"a": [0]} and out.num_scheduled_tokens["a"] == 6 + 8 + 3
    out = step(sched)
    assert encoded(out) == {"a": [1]}


def test_the_same_image_is_encoded_once():
    """Two requests with the same image in one step: one encoder run; a later request with
    it while it is cached: none (different text, so no prefix-cache hit)."""
    sched, _ = make(max_tokens=64, enable_prefix_caching=False)
    sched.add_request(image_request("a", [("same", 8)], text=5))
    sched.add_request(image_request("b", [("same", 8)], text=7))
    out = step(sched)
    assert sum(len(v) for v in out.scheduled_encoder_inputs.values()) == 1
    while sched.has_unfinished_requests():
        step(sched)
    sched.add_request(image_request("c", [("same", 8)], text=9))
    out = step(sched)
    assert not out.scheduled_encoder_inputs and set(out.encoder_rows) == {"same"}


def test_unused_images_are_evicted_least_recently_used_first():
    sched, ec = make(rows=16, budget=16, max_tokens=64, enable_prefix_caching=False)
    for i, ident in enumerate(["x", "y", "z"]):
        sched.add_request(image_request(f"r{i}", [(ident, 8)]))
        while sched.has_unfinished_requests():
            step(sched)
    assert list(ec.unused) == ["y", "z"]  # x went first to make room for z
    assert len(ec.free_rows) == 0 and sorted(np.concatenate(list(ec.cached.values()))) == list(
        range(16)
    )


def test_bidirectional_images_are_never_split():
    """Gemma 3's images attend both ways: a chunk that would end inside one stops before it."""
    sched, _ = make(max_tokens=12, bidirectional=True)
    sched.add_request(image_request("a", [("img", 8)]))  # image at 6..13
    out = step(sched)
    assert out.num_scheduled_tokens["a"] == 6 and not out.scheduled_encoder_inputs
    out = step(sched)
    assert out.num_scheduled_tokens["a"] == 11 and encoded(out) == {"a": [0]}


def test_an_image_waits_for_rows_held_by_another_request():
    """8 cache rows, all held by a's image while a runs its tokens: b runs its text up to
    its image; once a has run its image's tokens, b takes the rows (a's image evicted)."""
    sched, ec = make(rows=8, budget=8, max_tokens=8)
    sched.add_request(image_request("a", [("big", 8)], text=2))  # image at 2..9
    step(sched)  # a: 0..7, holding big
    sched.add_request(image_request("b", [("other", 8)], text=1))  # image at 1..8
    out = step(sched)  # a: 8..12; b: its one text token, then no rows for its image
    assert out.num_scheduled_tokens["b"] == 1 and not out.scheduled_encoder_inputs
    out = step(sched)
    assert encoded(out) == {"b": [0]} and "big" not in ec.cached
    while sched.has_unfinished_requests():
        step(sched)
    assert not ec.users


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_finished_and_preempted_requests_let_go(how):
    sched, ec = make(max_tokens=8)
    r = image_request("a", [("img", 8)], text=2)  # image at 2..9, chunked over two steps
    sched.add_request(r)
    step(sched)
    assert ec.users == {"img": {"a"}}
    if how == "abort":
        sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    else:
        sched._preempt(r)
        assert r.status == RequestStatus.PREEMPTED
    assert not ec.users and set(ec.unused) == {"img"}
