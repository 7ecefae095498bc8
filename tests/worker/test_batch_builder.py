"""The batch builder against hand-made scheduler outputs: the flat batch (token ids,
positions, slot mapping), query start locations, block tables, logits indices, draft rows,
placeholders and prompt-logprob targets, exactly; no device involved."""

import pytest

from jaxserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.batch_builder import BatchBuilder
from jaxserve.worker.buckets import BucketTable
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_state import NO_DRAFT

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def make(num_spec_tokens=0, decode_only_forwards=True):
    buckets = BucketTable.build(4, 16, num_spec_tokens)
    builder = BatchBuilder(
        buckets, block_size=BLOCK, max_model_len=32, max_blocks_per_req=8, vocab_size=100,
        num_spec_tokens=num_spec_tokens, decode_only_forwards=decode_only_forwards,
    )  # fmt: skip
    return builder, InputBatch(4, 32, 8)


def new(req_id, prompt, blocks, params=GREEDY, computed=0, output=()):
    return NewRequestData(req_id, list(prompt), list(output), params, (list(blocks),), computed, 2)


def output(new_reqs=(), cached=(), scheduled=None, sampled=None, drafts=None, finished=()):
    scheduled = scheduled or {}
    return SchedulerOutput(
        list(new_reqs), list(cached), scheduled, sum(scheduled.values()), set(finished), set(),
        sampled_req_ids=set(scheduled if sampled is None else sampled),
        scheduled_spec_decode_tokens=drafts or {},
    )  # fmt: skip


def step(builder, ib, so, step_count=0):
    ib.update(so)
    return builder.build(so, ib, builder.buckets.tokens, step_count)


def test_two_prefills_then_two_decodes():
    builder, ib = make()
    so = output(
        [new("a", [10, 11, 12, 13, 14], [1, 2]), new("b", [20, 21, 22], [3])],
        scheduled={"a": 5, "b": 3},
    )
    b = step(builder, ib, so)
    f = b.forward
    assert b.num_tokens == 8 and b.req_ids == ["a", "b"]
    assert f.input_ids.tolist() == [10, 11, 12, 13, 14, 20, 21, 22]
    assert f.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # a: positions 0-3 in block 1, 4 in block 2; b: block 3
    assert f.attn.slot_mapping[0].tolist() == [4, 5, 6, 7, 8, 12, 13, 14]
    assert f.attn.query_start_loc.tolist() == [0, 5, 8, 8, 8]  # 4 sequence rows at T = 8
    assert f.attn.kv_lens.tolist() == [5, 3, 0, 0]
    assert f.attn.block_tables[0, :2, :2].tolist() == [[1, 2], [3, 0]]
    assert int(f.attn.num_seqs[0]) == 2 and not f.attn.decode_only
    assert f.logits_indices.tolist() == [4, 7, 0, 0]  # each request's last token
    assert b.sample.rows.tolist() == [ib.req_id_to_row["a"], ib.req_id_to_row["b"]]
    assert b.sample.appends.tolist() == [True, True]
    # the sampled tokens are the input batch's once fetched (ib.append_sampled)
    a, bb = ib.req_id_to_row["a"], ib.req_id_to_row["b"]
    assert ib.num_tokens[[a, bb]].tolist() == [5, 3]
    assert b.sampled.tolist() == [True, True] and not b.ahead.any()

    so = output(
        cached=[CachedRequestData("a", (), 5), CachedRequestData("b", (), 3)],
        scheduled={"a": 1, "b": 1},
    )
    b = step(builder, ib, so, step_count=1)
    f = b.forward
    assert b.num_tokens == 2 and f.attn.decode_only
    assert f.input_ids.tolist() == [-1, -1]  # each row's kept token, from the step state
    assert b.ahead.tolist() == [True, True]
    assert f.token_rows.tolist() == [a, bb]
    assert f.positions.tolist() == [5, 3]
    assert f.attn.slot_mapping[0].tolist() == [9, 15]
    assert f.attn.query_start_loc.tolist() == [0, 1, 2]
    assert int(b.sample.step) == 1


def test_a_chunked_prompt_starts_where_the_scheduler_says():
    builder, ib = make()
    prompt = list(range(30, 42))  # 12 tokens in chunks of 8 and 4
    b = step(builder, ib, output([new("a", prompt, [1, 2, 3])], scheduled={"a": 8}, sampled=()))
    assert b.forward.positions.tolist() == list(range(8))
    assert not b.sampled.any() and not b.sample.appends.any()
    b = step(builder, ib, output(cached=[CachedRequestData("a", (), 8)], scheduled={"a": 4}))
    f = b.forward
    assert b.num_tokens == 4 and f.positions.tolist() == [8, 9, 10, 11]
    assert f.input_ids.tolist() == prompt[8:]
    assert f.attn.slot_mapping[0].tolist() == [12, 13, 14, 15]  # block 3
    assert f.attn.kv_lens.tolist()[:1] == [12] and f.logits_indices[0] == 3


def test_a_decode_step_without_decode_only_forwards_runs_the_general_forward():
    builder, ib = make(decode_only_forwards=False)
    b = step(builder, ib, output([new("a", [5], [1])], scheduled={"a": 1}))
    assert not b.forward.attn.decode_only


def test_draft_rows_follow_each_request_and_count_earlier_drafts():
    builder, ib = make(num_spec_tokens=2)
    step(builder, ib, output([new("a", [3, 4, 5], [1]), new("b", [6, 7], [2])],
                             scheduled={"a": 3, "b": 2}))  # fmt: skip
    a, bb = ib.req_id_to_row["a"], ib.req_id_to_row["b"]
    ib.token_ids[a, 3], ib.token_ids[bb, 2] = 50, 60  # the first step's tokens, fetched
    ib.num_tokens[[a, bb]] += 1
    so = output(
        cached=[CachedRequestData("a", (), 3), CachedRequestData("b", (), 2)],
        scheduled={"a": 3, "b": 1}, drafts={"a": [51, 52]},
    )  # fmt: skip
    b = step(builder, ib, so)
    assert b.forward.input_ids.tolist() == [50, 51, 52, 60]
    assert b.forward.positions.tolist() == [3, 4, 5, 2]
    assert ib.token_ids[a, 4:6].tolist() == [51, 52]  # the drafts are in place
    assert b.first_row.tolist() == [0, 3] and b.num_rows.tolist() == [3, 1]
    assert b.forward.logits_indices[:4].tolist() == [0, 1, 2, 3]  # every draft position
    assert b.sample.rows[:4].tolist() == [a, a, a, bb]
    assert b.sample.prior_drafts.tolist() == [[-1, -1], [51, -1], [51, 52], [-1, -1]]
    # the penalties count b's kept token on the device; a's (drafted) at fetch
    assert b.sample.appends.tolist() == [False, False, False, True]
    assert b.sample.settle.verify.tolist()[:4] == [51, 52, NO_DRAFT, NO_DRAFT]
    assert not b.forward.attn.decode_only  # drafts make more than one token

    # Scheduled again before that step is fetched (async scheduling): a's kept token and
    # two drafts are placeholders of its step-state columns, at the host's positions (all
    # drafts counted as accepted: the forward moves them back by those rejected).
    so = output(
        cached=[CachedRequestData("a", (), 6), CachedRequestData("b", (), 3)],
        scheduled={"a": 3, "b": 1}, drafts={"a": [-1, -1]},
    )  # fmt: skip
    b = step(builder, ib, so)
    assert b.ahead.tolist() == [True, True]
    assert b.forward.input_ids.tolist() == [-1, -2, -3, -1]
    assert b.forward.positions.tolist() == [6, 7, 8, 3]
    assert b.sample.settle.verify.tolist()[:4] == [-2, -3, NO_DRAFT, NO_DRAFT]
    settle = b.sample.settle
    assert settle.req_ahead[:2].tolist() == [True, True]
    assert settle.req_drafts[:2].tolist() == [2, 0] and settle.req_last_pos[:2].tolist() == [8, 3]
    assert ib.token_ids[a, 4:6].tolist() == [51, 52]  # nothing written for placeholders
    assert ib.num_tokens[[a, bb]].tolist() == [4, 3]


def test_prompt_logprob_targets_are_the_next_prompt_tokens():
    builder, ib = make()
    wants = SamplingParams(temperature=0.0, prompt_logprobs=1)
    so = output([new("a", [10, 11, 12], [1], wants), new("b", [20, 21], [2])],
                scheduled={"a": 3, "b": 2})  # fmt: skip
    b = step(builder, ib, so)
    assert b.wants_prompt_lp.tolist() == [True, False]
    assert b.targets.tolist() == [11, 12, -1, -1, -1, -1, -1, -1]


def test_a_resumed_request_gets_its_outputs_and_the_row_counts_them():
    builder, ib = make()
    params = SamplingParams(temperature=0.0, min_tokens=3)
    so = output([new("a", [10, 11], [1], params, output=[12])], scheduled={"a": 3})
    b = step(builder, ib, so)
    assert b.forward.input_ids.tolist()[:3] == [10, 11, 12]
    # one output before the sampled token: still under min_tokens, EOS (2) is blocked
    assert b.sample.sampling.output_positions[0] == 1
    assert 2 in b.sample.sampling.bias_token_ids[0].tolist() and b.needed.bias


def test_nothing_scheduled_builds_nothing_and_finished_rows_are_freed():
    builder, ib = make()
    step(builder, ib, output([new("a", [1, 2], [1])], scheduled={"a": 2}))
    assert step(builder, ib, output(finished=["a"])) is None
    assert "a" not in ib.req_id_to_row and len(ib.free_rows) == 4


@pytest.mark.parametrize(("ready", "padded"), [((1, 8, 16), 8), ((1, 2, 4, 8, 16), 4)])
def test_a_step_pads_to_the_smallest_ready_token_bucket(ready, padded):
    builder, ib = make()
    ib.update(so := output([new("a", [1, 2, 3], [1])], scheduled={"a": 3}))
    b = builder.build(so, ib, ready, 0)
    assert b.num_tokens == padded and len(b.forward.input_ids) == padded
    assert b.forward.attn.slot_mapping[0].tolist()[3:] == [-1] * (padded - 3)  # writes nothing
