"""Scheduler behaviour with a scripted stand-in for the model runner."""

import zlib

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import ModelRunnerOutput
from jaxserve.ipc.messages import SpecDecodingStats
from jaxserve.sampling_params import SamplingParams

EOS = 2
BS = 4


def make_scheduler(num_blocks=64, max_tokens=64, max_seqs=8, policy="fcfs", max_len=256, **cache):
    return Scheduler(
        SchedulerConfig(max_len, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                        policy=policy),
        CacheConfig(block_size=BS, **cache),
        num_blocks,
    )  # fmt: skip


def req(req_id, n_prompt=10, *, priority=0, arrival=0.0, **params):
    params.setdefault("max_tokens", 5)
    prompt = [10 + (zlib.crc32(req_id.encode()) + i) % 50 for i in range(n_prompt)]
    return Request(req_id, prompt, SamplingParams(**params), eos_token_id=EOS, block_size=BS,
                   arrival_time=arrival, priority=priority)  # fmt: skip


def step(sched, next_token=lambda req_id: 7):
    """One schedule + fake execution; returns (scheduler output, engine core outputs)."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(ids, np.array([next_token(r) for r in ids], np.int32))
    return out, sched.update_from_output(out, runner)


def drain(sched, max_steps=200, **kw):
    """Step until nothing is left; returns every step's SchedulerOutput."""
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        outputs.append(step(sched, **kw)[0])
    raise AssertionError("did not drain")


def assert_pool_clean(sched):
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
    assert not sched.requests
    kv.check_no_leaks()


def test_chunked_prefill_splits_prompt_across_steps_and_discards_partial_tokens():
    sched = make_scheduler(max_tokens=16)
    sched.add_request(req("a", 40))
    out1, res1 = step(sched)
    assert out1.num_scheduled_tokens == {"a": 16} and res1 == []
    out2, res2 = step(sched)
    assert out2.num_scheduled_tokens == {"a": 16} and res2 == []
    out3, res3 = step(sched)
    assert out3.num_scheduled_tokens == {"a": 8}
    assert res3[0].new_token_ids == [7]  # the prompt is complete: first token counts
    out4, _ = step(sched)
    assert out4.num_scheduled_tokens == {"a": 1}
    assert out4.scheduled_cached_reqs[0].num_computed_tokens == 40


def test_running_first_then_waiting_within_budget_and_max_num_seqs():
    sched = make_scheduler(max_tokens=32, max_seqs=2)
    for name in "abc":
        sched.add_request(req(name, 10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 10, "b": 10}  # max_num_seqs=2 keeps c waiting
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    drain(sched)
    assert_pool_clean(sched)


def test_stop_conditions():
    sched = make_scheduler()
    sched.add_request(req("eos", max_tokens=10))
    sched.add_request(req("ignore", max_tokens=3, ignore_eos=True))
    sched.add_request(req("stopid", max_tokens=10, stop_token_ids=[9]))
    sched.add_request(req("min", max_tokens=10, min_tokens=3))
    finished = {}
    tokens = {"eos": EOS, "ignore": EOS, "stopid": 9, "min": EOS}
    for _ in range(10):
        _, outs = step(sched, next_token=tokens.__getitem__)
        finished.update({o.request_id: o for o in outs if o.finished})
    assert finished["eos"].finish_reason == "stop" and finished["eos"].stop_reason is None
    assert finished["ignore"].finish_reason == "length"
    assert finished["stopid"].finish_reason == "stop" and finished["stopid"].stop_reason == 9
    assert finished["min"].finish_reason == "stop"
    assert_pool_clean(sched)


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_len=12)
    r = req("a", 10, max_tokens=100)
    sched.add_request(r)
    drain(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 12


def test_abort_frees_blocks_and_is_reported_to_the_runner():
    sched = make_scheduler()
    sched.add_request(req("a", 10, max_tokens=50))
    sched.add_request(req("b", 10, max_tokens=50))
    step(sched)
    aborted = sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["a"]
    out, _ = step(sched)
    assert out.finished_req_ids == {"a"} and set(out.num_scheduled_tokens) == {"b"}
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert_pool_clean(sched)


def test_preemption_frees_latest_and_resumes_with_its_tokens():
    # 9 usable blocks of 4 tokens: two 12-token prompts fit, decoding past 16 each does not.
    sched = make_scheduler(num_blocks=10, enable_prefix_caching=False)
    a, b = req("a", 12, max_tokens=12, arrival=1.0), req("b", 12, max_tokens=12, arrival=2.0)
    sched.add_request(a)
    sched.add_request(b)
    outs = drain(sched)
    preempted = [r for out in outs for r in out.preempted_req_ids]
    resumed = [n for out in outs for n in out.scheduled_new_reqs if n.output_token_ids]
    for n in resumed:  # a resumed request is sent in full, its generated tokens included
        assert n.req_id == "b" and n.num_computed_tokens == 0
    assert resumed and preempted and set(preempted) == {"b"}  # the latest arrival is the victim
    assert b.num_preemptions >= 1 and sched.make_stats().num_preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert_pool_clean(sched)


def test_priority_policy_orders_and_preempts_by_priority():
    sched = make_scheduler(max_seqs=1, policy="priority")
    sched.add_request(req("low", priority=5, arrival=1.0))
    sched.add_request(req("high", priority=0, arrival=2.0))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["high"]

    sched = make_scheduler(num_blocks=10, policy="priority", enable_prefix_caching=False)
    sched.add_request(req("vip", 12, priority=0, arrival=2.0, max_tokens=12))
    sched.add_request(req("bulk", 12, priority=9, arrival=1.0, max_tokens=12))
    preempted = [r for out in drain(sched) for r in out.preempted_req_ids]
    assert preempted and set(preempted) == {"bulk"}
    assert_pool_clean(sched)


def test_prefix_cache_hit_for_a_repeated_prompt():
    sched = make_scheduler()
    first = req("first", 13)
    sched.add_request(first)
    drain(sched)
    again = Request("again", first.prompt_token_ids, SamplingParams(max_tokens=2),
                    eos_token_id=EOS, block_size=BS)  # fmt: skip
    sched.add_request(again)
    out, _ = step(sched)
    assert again.num_cached_tokens == 12  # 3 full blocks; the last token is recomputed
    assert out.num_scheduled_tokens == {"again": 1}
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 12 and stats.prefix_cache_queries == 26
    drain(sched)
    assert_pool_clean(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_drains_clean(policy):
    rng = np.random.default_rng(0)
    sched = make_scheduler(num_blocks=24, max_tokens=24, max_seqs=4, policy=policy)
    for i in range(12):
        sched.add_request(
            req(f"r{i}", int(rng.integers(1, 30)), priority=int(rng.integers(0, 3)),
                arrival=float(i), max_tokens=int(rng.integers(1, 20)))
        )  # fmt: skip
    for s in range(300):
        if not sched.has_unfinished_requests():
            break
        if s == 5:
            sched.finish_requests(["r3", "r7"], RequestStatus.FINISHED_ABORTED)
        step(sched, next_token=lambda r: int(rng.integers(3, 60)))
    assert not sched.has_unfinished_requests()
    assert_pool_clean(sched)


def test_prompt_logprobs_survive_chunking_and_preemption_once_each():
    """Chunks add positions in order; a recompute after preemption adds nothing twice; the
    first token carries every prompt position, cut to the prompt_logprobs + 1 asked for."""
    from jaxserve.core.scheduler_output import PromptLogprobs

    r = req("p", n_prompt=12, prompt_logprobs=1)

    def chunk(first, last):  # positions first..last; logprob of position p is -p
        n, cols = last - first + 1, 4
        lp = -np.repeat(np.arange(first, last + 1, dtype=np.float32)[:, None], cols, 1)
        return PromptLogprobs(first, lp, np.zeros((n, cols), np.int32), np.ones(n, np.int32))

    r.add_prompt_logprobs(chunk(1, 4))
    r.add_prompt_logprobs(chunk(1, 4))  # recomputed after a preemption
    r.add_prompt_logprobs(chunk(1, 8))
    r.add_prompt_logprobs(chunk(9, 11))
    values, ids, ranks = r.take_prompt_logprobs()
    assert [v[0] for v in values] == [-p for p in range(1, 12)]
    assert all(len(v) == 2 for v in values) and len(ids) == len(ranks) == 11
    with pytest.raises(RuntimeError, match="skipped positions"):
        r.add_prompt_logprobs(chunk(13, 14))


def drain_outputs(sched, next_token, *, pipelined, aborts=None, max_steps=1000):
    """Step until drained, as EngineCore does: pipelined = async scheduling (step N+1 is
    scheduled before step N's tokens come back). next_token(request_id, index of the output
    token) plays the model. aborts: {step number: request ids}. Returns ({request id: tokens},
    {request id: finish reason}, every SchedulerOutput), once every output is delivered."""
    from collections import defaultdict, deque

    tokens, reasons, scheduled, in_flight = defaultdict(list), {}, [], deque()
    for n in range(max_steps):
        if not (sched.has_unfinished_requests() or in_flight or sched.pending_outputs):
            return tokens, reasons, scheduled
        if aborts and n in aborts:
            for r in sched.finish_requests(aborts[n], RequestStatus.FINISHED_ABORTED):
                reasons[r.request_id] = "abort"
        dispatched = False
        if sched.has_unfinished_requests():
            out = sched.schedule()
            if out.total_num_scheduled_tokens:
                in_flight.append(out)
                scheduled.append(out)
                dispatched = True
        if not in_flight:  # requests that failed outside a step (EngineCore sends them too)
            outputs = sched.take_pending_outputs()
        elif dispatched and pipelined and len(in_flight) < 2:
            continue
        else:
            out = in_flight.popleft()
            ids = list(out.num_scheduled_tokens)
            # The token a request samples in `out` is its output number len(outputs so far).
            index = {r: sched.requests[r].num_output_tokens if r in sched.requests else -1
                     for r in ids}  # fmt: skip
            sampled = np.array([next_token(r, index[r]) for r in ids], np.int32)
            outputs = sched.update_from_output(out, ModelRunnerOutput(ids, sampled))
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:  # a failed request's: "error: <the exception>"
                error = o.finish_reason == "error"
                reasons[o.request_id] = f"error: {o.stop_reason}" if error else o.finish_reason
    raise AssertionError("did not drain")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_async_scheduling_gives_the_same_tokens_and_never_overshoots(policy):
    """Scheduling one step ahead on placeholder tokens: every request gets exactly the tokens
    and finish reason of synchronous scheduling, through EOS, stop tokens, max_tokens,
    max_model_len, chunked prefill, preemption and aborts; no step runs a request past
    max_tokens or max_model_len; every block comes back."""

    def next_token(req_id, i):  # EOS for some requests at some point, stop id 9 for others
        h = zlib.crc32(f"{req_id}/{i}".encode())
        return EOS if h % 13 == 0 else 9 if h % 17 == 0 else 20 + h % 30

    def workload():
        rng = np.random.default_rng(1)
        sched = make_scheduler(num_blocks=20, max_tokens=24, max_seqs=4, policy=policy,
                               max_len=40)  # fmt: skip
        for i in range(16):
            params = dict(max_tokens=int(rng.integers(1, 25)))
            if i % 3 == 0:
                params["stop_token_ids"] = [9]
            if i % 5 == 0:
                params["min_tokens"] = 2
            sched.add_request(req(f"r{i}", int(rng.integers(1, 30)), arrival=float(i),
                                  priority=int(rng.integers(0, 3)), **params))  # fmt: skip
        return sched

    aborts = {6: ["r4", "r11"]}
    sync_sched, async_sched = workload(), workload()
    sync = drain_outputs(sync_sched, next_token, pipelined=False, aborts=aborts)
    pipelined = drain_outputs(async_sched, next_token, pipelined=True, aborts=aborts)
    unaborted = lambda d: {k: v for k, v in d.items() if k not in ("r4", "r11")}  # noqa: E731
    assert unaborted(pipelined[0]) == unaborted(sync[0])
    assert pipelined[1] == sync[1] and len(sync[1]) == 16
    assert sync_sched.total_preemptions and async_sched.total_preemptions
    # A step may run past a stop only because the stopping token was not known yet: at most
    # one extra sample after EOS / a stop token, none past max_tokens or max_model_len.
    runs = {}
    for out in pipelined[2]:
        for req_id in out.sampled_req_ids:
            runs[req_id] = runs.get(req_id, 0) + 1
    tokens, reasons = pipelined[0], pipelined[1]
    for req_id, reason in reasons.items():
        if reason == "length":
            assert runs[req_id] == len(tokens[req_id]), req_id
        elif reason == "stop":
            assert len(tokens[req_id]) <= runs[req_id] <= len(tokens[req_id]) + 1, req_id
    assert any(runs[r] > len(tokens[r]) for r in reasons if reasons[r] == "stop")
    for sched in (sync_sched, async_sched):
        assert_pool_clean(sched)


def test_async_scheduling_drops_the_token_after_a_stop_and_respects_max_tokens():
    sched = make_scheduler()
    sched.add_request(req("eos", max_tokens=10))
    sched.add_request(req("short", max_tokens=2, ignore_eos=True))
    tokens, reasons, outs = drain_outputs(
        sched, lambda r, i: EOS if (r, i) == ("eos", 1) else 7, pipelined=True
    )
    assert tokens == {"eos": [7, EOS], "short": [7, 7]}
    assert reasons == {"eos": "stop", "short": "length"}
    # "eos" ran one step past its stop (its token was not known yet); "short" never did.
    assert sum("eos" in o.sampled_req_ids for o in outs) == 3
    assert sum("short" in o.sampled_req_ids for o in outs) == 2
    assert_pool_clean(sched)


def spec_scheduler(**kw):
    sched = make_scheduler(**kw)
    sched.spec_stats = SpecDecodingStats()  # as Scheduler(..., speculative=True)
    return sched


def spec_step(sched, truth, drafts_for):
    """One step against a scripted target: request r's true continuation is truth[r] (a
    list); drafts equal to it are accepted up to the first that differs, as the runner does.
    drafts_for(r, tokens so far) are the next drafts the proposer hands back."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled, accepted, proposed = [], {}, {}
    for r in ids:
        so_far = sched.requests[r].output_token_ids
        drafts = out.scheduled_spec_decode_tokens.get(r, [])
        a = 0
        while a < len(drafts) and drafts[a] == truth[r][len(so_far) + a]:
            a += 1
        sampled.append(truth[r][len(so_far) + a])
        if drafts:
            accepted[r] = drafts[:a]
        proposed[r] = drafts_for(r, [*so_far, *drafts[:a], sampled[-1]])
    runner = ModelRunnerOutput(ids, np.array(sampled, np.int32), accepted_drafts=accepted)
    runner.spec_token_ids = proposed
    return out, sched.update_from_output(out, runner)


def test_drafts_are_budgeted_accepted_and_rolled_back():
    """A decode runs its drafts after its last token within the token budget; accepted drafts
    come out before the sampled token, rejected ones leave num_computed_tokens."""
    sched = spec_scheduler(max_tokens=4)
    truth = {"a": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]}
    sched.add_request(req("a", n_prompt=4, max_tokens=10, ignore_eos=True))
    guesses = iter([[21, 22, 99, 98], [25, 26, 27], [29]])
    out, outs = spec_step(sched, truth, lambda r, toks: next(guesses))
    assert out.num_scheduled_tokens == {"a": 4} and outs[0].new_token_ids == [20]
    # Budget 4: the token and 3 of the 4 drafts; 21, 22 accepted, 99 rejected, 23 sampled.
    out, outs = spec_step(sched, truth, lambda r, toks: next(guesses))
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22, 99]}
    assert out.num_scheduled_tokens == {"a": 4}
    assert outs[0].new_token_ids == [21, 22, 23]
    request = sched.requests["a"]
    assert request.num_computed_tokens == request.num_tokens - 1 == 4 + 4 - 1
    # 25, 26 wrong from the start (24 comes first): only the sampled token.
    out, outs = spec_step(sched, truth, lambda r, toks: next(guesses))
    assert outs[0].new_token_ids == [24]
    stats = sched.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert sched.make_stats().spec_decoding.num_drafts == 0  # reset after each snapshot


def test_drafts_stop_at_max_tokens_and_at_a_stop_inside_them():
    sched = spec_scheduler()
    truth = {"long": [30, 31, 32, 33, 34, 35, 36, 37], "eos": [40, 41, EOS, 43, 44, 45, 46, 47, 48]}
    sched.add_request(req("long", max_tokens=4, ignore_eos=True))
    sched.add_request(req("eos", max_tokens=8))
    outputs, scheduled = {}, {}
    for _ in range(6):
        if not sched.has_unfinished_requests():
            break
        out, outs = spec_step(sched, truth, lambda r, toks: truth[r][len(toks) :][:5])
        for r, d in out.scheduled_spec_decode_tokens.items():
            scheduled.setdefault(r, []).append(d)
        for o in outs:
            outputs[o.request_id] = outputs.get(o.request_id, []) + o.new_token_ids
    # max_tokens=4: after the first token at most 2 drafts (the sampled one makes 4).
    assert scheduled["long"] == [[31, 32]] and outputs["long"] == [30, 31, 32, 33]
    # EOS accepted as a draft ends the request there: 43, 44 are never output.
    assert outputs["eos"] == [40, 41, EOS]
    assert_pool_clean(sched)


def test_drafts_give_way_to_preemption_before_requests_do():
    """With too few free blocks for a request's drafts, it runs without them instead of
    preempting another request."""
    sched = spec_scheduler(num_blocks=6, max_tokens=64)  # 5 usable blocks of 4 tokens
    truth = {"a": list(range(60, 80)), "b": list(range(80, 100))}
    sched.add_request(req("a", n_prompt=8, max_tokens=3, ignore_eos=True))
    sched.add_request(req("b", n_prompt=7, max_tokens=3, ignore_eos=True))
    spec_step(sched, truth, lambda r, toks: [1, 2, 3, 4, 5, 6])  # prompts: 2 + 2 blocks
    out, _ = spec_step(sched, truth, lambda r, toks: [])
    assert sched.total_preemptions == 0
    # a's draft takes the last free block; b's would need another: b runs without it.
    assert out.scheduled_spec_decode_tokens == {"a": [1]}
    assert out.num_scheduled_tokens == {"a": 2, "b": 1}
    drain(sched)
    assert_pool_clean(sched)


def test_drafts_fill_a_step_only_up_to_its_draft_step_tokens():
    """draft_step_tokens=6: 3 decodes (their own power of two: 4) may add 3 draft tokens;
    8 decodes fill a power of two already, so none."""
    for n_reqs, expected in ((3, {"r0": [1, 2, 3]}), (8, {})):
        sched = spec_scheduler()
        sched.draft_step_tokens = 6
        truth = {f"r{i}": list(range(40, 60)) for i in range(n_reqs)}
        for r in truth:
            sched.add_request(req(r, n_prompt=4, max_tokens=10, ignore_eos=True))
        spec_step(sched, truth, lambda r, toks: [1, 2, 3, 4])
        out, _ = spec_step(sched, truth, lambda r, toks: [])
        assert out.scheduled_spec_decode_tokens == expected, n_reqs
