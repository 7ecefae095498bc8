"""Async scheduling with speculative decoding (EAGLE-3, MTP, draft models): the next step is
scheduled and dispatched before the previous one is fetched, its drafts placeholders the
devices proposed, its positions moved back by the drafts the step before rejected. Output is
identical to the same speculation without async scheduling (greedy, seeded and penalised
requests, chunked prefill, preemption), drafts are accepted and counted in /metrics, and no
KV block leaks."""

import numpy as np
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import hf_model, make_tiny_hf
from tests.models.test_moe import FAMILIES
from tests.worker.spec_decode.test_eagle import (  # eagle3_head: a fixture
    K,
    TorchEagle3,
    eagle3_head,  # noqa: F401
)
from tests.worker.spec_decode.test_mtp import make_tiny_mtp
from tests.worker.spec_decode.test_spec_decode import (
    AcceptCounter,
    core,
    record_drafts,
    token_ids,
)
from tests.worker.spec_decode.test_tiny_models import tiny_pair  # noqa: F401 (a fixture)

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32",
              enable_prefix_caching=False)  # fmt: skip


def count_drafts_ahead(llm) -> dict[str, int]:
    """Counts, over the async engine's steps, the requests scheduled with placeholder drafts
    (their previous step in flight), the steps dispatched while another was in flight, and
    the drafts rejected in a step that a later step had already run ahead of (that step's
    positions moved back on the device)."""
    seen = {"ahead": 0, "overlapped": 0, "moved_back": 0}
    engine = core(llm)
    scheduler = engine.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def counting(*args, **kwargs):
        out = schedule(*args, **kwargs)
        seen["ahead"] += sum(d[:1] == [-1] for d in out.scheduled_spec_decode_tokens.values())
        seen["overlapped"] += bool(engine.in_flight) and bool(out.num_scheduled_tokens)
        return out

    def updating(so, ro):
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            request = scheduler.requests.get(req_id)
            later = request is not None and request.num_output_placeholders > 1 + len(drafts)
            rejected = len(drafts) - len(ro.accepted_drafts.get(req_id, drafts))
            seen["moved_back"] += later and rejected > 0
        return update(so, ro)

    scheduler.schedule, scheduler.update_from_output = counting, updating
    return seen


def mixed_requests(vocab: int, n: int = 4):
    """Prompts of 5 to 40 tokens (chunked at 16), and their sampling: greedy ones, a seeded
    sampled one and a penalised one (these two wait for each drafted step's results)."""
    rng = np.random.default_rng(3)
    prompts = [
        {"prompt_token_ids": rng.integers(0, vocab, m).tolist()} for m in (5, 23, 40, 11)[:n]
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
    ][:n]
    return prompts, params


def check_async_equals_sync(path, spec, prompts, params, before=None, **engine):
    """The async engine's outputs equal the sync engine's (both speculating); returns the
    async engine's acceptance counter and the engine (before: called with its runner first)."""
    sync = LLM(str(path), **ENGINE, **engine, speculative_config=spec)
    want = token_ids(sync.generate(prompts, params, use_tqdm=False))
    llm = LLM(str(path), **ENGINE, **engine, speculative_config=spec, async_scheduling=True)
    assert core(llm).max_in_flight == 2 and core(llm).scheduler.drafts_ahead == K
    if before is not None:
        before(core(llm).runner)
    counter, seen = AcceptCounter(llm), count_drafts_ahead(llm)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    core(llm).scheduler.kv_cache_manager.check_no_leaks()
    metrics = counter.metrics()  # the acceptance as /metrics reports it
    assert metrics["spec_decode_num_draft_tokens"] == counter.drafted > 0
    assert metrics["spec_decode_num_accepted_tokens"] == counter.accepted
    assert seen["ahead"] > 5 and seen["overlapped"] > 5, seen
    all_accepted = counter.accepted == counter.drafted
    assert all_accepted or seen["moved_back"] > 2, seen  # rejections behind a later step
    return counter, llm


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_with_async_scheduling_equals_mtp_without(tmp_path, monkeypatch, tp):
    """MTP on a tiny DeepSeek-V3 whose MTP layer nearly repeats it (high acceptance, some
    rejections): the async engine's greedy, seeded and penalised outputs are the sync
    engine's, through chunked prefill and, with few KV blocks, preemption."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    shape = dict(first_k_dense_replace=0)
    path, _ = make_tiny_mtp("deepseek_v3", tmp_path / "ds", 2, copy_layer0=True, **shape)
    prompts, params = mixed_requests(256)
    spec = {"method": "mtp", "num_speculative_tokens": K}
    engine = dict(tensor_parallel_size=tp, num_gpu_blocks_override=6 if tp == 1 else None)
    counter, llm = check_async_equals_sync(path, spec, prompts, params, **engine)
    assert counter.drafted / 4 < counter.accepted < counter.drafted, vars(counter)
    if tp == 1:
        assert core(llm).scheduler.total_preemptions > 0


def test_eagle3_on_a_moe_target_with_async_scheduling(eagle3_head, tmp_path, monkeypatch):  # noqa: F811
    """EAGLE-3 over a Qwen3-MoE target: async and sync outputs equal, and every draft the
    async engine proposed (its head's cache mirrored from steps whose positions moved back)
    is the one a PyTorch EAGLE-3 recomputed from scratch drafts there."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    target = make_tiny_hf("qwen3_moe", tmp_path / "moe", vocab_size=16, **FAMILIES["qwen3_moe"])
    prompts, params = mixed_requests(16, n=3)
    spec = {"method": "eagle3", "model": str(eagle3_head), "num_speculative_tokens": K}
    proposed = []
    _, llm = check_async_equals_sync(
        target, spec, prompts, params, before=lambda llm: proposed.extend([record_drafts(llm)])
    )
    reference = TorchEagle3(eagle3_head, hf_model(str(target)))
    assert len(proposed[0]) > 3
    for tokens, drafts in proposed[0]:
        assert drafts == reference.drafts(tokens, K), tokens


def test_draft_model_with_async_scheduling(tiny_pair, monkeypatch):  # noqa: F811
    """A draft model (a smaller random one: most drafts rejected, so the next step's
    positions move back; the target itself: all accepted) under async scheduling."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    target, draft = tiny_pair
    prompts, params = mixed_requests(256)
    for path in (draft, target):
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}
        counter, _ = check_async_equals_sync(target, spec, prompts, params)
        if path == target:
            assert counter.accepted == counter.drafted, vars(counter)
