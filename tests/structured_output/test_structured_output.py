"""Structured outputs in the engine core: a request waits for its grammar, each step's
bitmask follows the grammar, reasoning gates it, and the sampler applies the mask."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.request import RequestStatus
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.layers.sampler import apply_token_bitmask
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output import StructuredOutputManager
from tests.core.test_scheduler import make_scheduler, req, step


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.transformers_utils.model_path import default_model_path
    from jaxserve.transformers_utils.tokenizer import read_tokenizer

    return read_tokenizer(default_model_path())


def manager(reasoning_parser=None) -> StructuredOutputManager:
    config = EngineArgs(reasoning_parser=reasoning_parser).create_engine_config()
    return StructuredOutputManager(config)


def allowed(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab])


def test_a_request_waits_for_its_grammar_and_steps_follow_it(tokenizer):
    som = manager()
    gate = threading.Event()
    compile_grammar = som.backend.compile_grammar

    def slow(params):
        gate.wait(10)
        return compile_grammar(params)

    som.backend.compile_grammar = slow
    sched = make_scheduler()
    sched.grammars.manager = som
    so = StructuredOutputsParams(choice=["Paris", "Rome"])
    constrained, free = req("c", structured_outputs=so), req("f")
    sched.add_request(constrained)
    sched.add_request(free)
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["f"]  # c is still compiling: f goes first
    assert constrained.status == RequestStatus.WAITING_FOR_FSM
    gate.set()
    constrained.structured_output_request.future.result(10)

    paris = tokenizer.encode("Paris", add_special_tokens=False)
    tokens = iter(paris)
    out = sched.schedule()
    assert out.structured_output_req_ids == {"c"}
    ids = list(out.num_scheduled_tokens)
    mask = sched.grammar_bitmask(ids, out.sampled_req_ids, range(len(ids)), [[]] * len(ids),
                                 len(ids))  # fmt: skip
    vocab = som.vocab_size
    c_row, f_row = ids.index("c"), ids.index("f")
    assert len(allowed(mask[f_row], vocab)) == vocab  # the free row: everything
    first = allowed(mask[c_row], vocab)
    assert paris[0] in first and len(first) < 10  # only beginnings of Paris / Rome

    from jaxserve.core.scheduler_output import ModelRunnerOutput

    runner = ModelRunnerOutput(ids, np.array([next(tokens) if r == "c" else 7 for r in ids]))
    sched.update_from_output(out, runner)
    while not constrained.is_finished:
        _, outputs = step(sched, lambda r: next(tokens) if r == "c" else 7)
    assert tokenizer.decode(constrained.output_token_ids) == "Paris"
    assert constrained.status == RequestStatus.FINISHED_STOPPED  # the grammar is complete


def test_a_grammar_that_fails_to_compile_fails_its_request_alone():
    som = manager()
    som.backend.compile_grammar = lambda params: (_ for _ in ()).throw(ValueError("boom"))
    sched = make_scheduler()
    sched.grammars.manager = som
    bad = req("bad", structured_outputs=StructuredOutputsParams(regex="a"))
    sched.add_request(bad)
    bad.structured_output_request.future.exception(10)
    sched.add_request(req("ok"))
    out, outputs = step(sched)
    assert list(out.num_scheduled_tokens) == ["ok"]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "error"), ("ok", None)]
    assert outputs[0].stop_reason == "ValueError: boom"
    sched.kv_cache_manager.check_no_leaks()


def test_with_a_reasoning_parser_the_grammar_binds_after_the_reasoning(tokenizer):
    som = manager("deepseek_r1")
    sched = make_scheduler()
    sched.grammars.manager = som
    r = req("r", structured_outputs=StructuredOutputsParams(choice=["yes"]), max_tokens=50)
    sched.add_request(r)
    r.structured_output_request.future.result(10)
    thinking = tokenizer.encode("Let me see.</think>", add_special_tokens=False)
    script = iter([*thinking, *tokenizer.encode("yes", add_special_tokens=False)])
    masks = []
    while not r.is_finished:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        masks.append(sched.grammar_bitmask(ids, out.sampled_req_ids, [0], [[]], 1))
        from jaxserve.core.scheduler_output import ModelRunnerOutput

        sched.update_from_output(out, ModelRunnerOutput(ids, np.array([next(script)])))
    assert all(m is None for m in masks[: len(thinking)])  # free while thinking
    assert masks[len(thinking)] is not None  # then constrained
    assert tokenizer.decode(r.output_token_ids) == "Let me see.</think>yes"
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_the_sampler_masks_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    vocab = 1000  # not a multiple of 32
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    keep = rng.random((3, vocab)) < 0.1
    keep[2] = True  # a free row
    words = np.zeros((3, -(-vocab // 32) * 32), bool)
    words[:, :vocab] = keep
    bitmask = np.packbits(words, axis=1, bitorder="little").view(np.int32)
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(out, np.where(keep, logits, -np.inf))


def test_draft_rows_get_the_masks_after_each_draft_and_invalid_drafts_are_cut(tokenizer):
    """Speculative decoding: row j of a drafted request is the grammar's mask after its first
    j drafts, rows after a draft the grammar refuses allow everything (that row's sample
    rejects the draft first), the grammar itself does not move, and the proposer's drafts
    are cut to the prefix the grammar accepts."""
    som = manager()
    sched = make_scheduler()
    sched.grammars.manager = som
    r = req("r", structured_outputs=StructuredOutputsParams(choice=["Paris is big"]))
    sched.add_request(r)
    r.structured_output_request.future.result(10)
    words = tokenizer.encode("Paris is big", add_special_tokens=False)
    assert len(words) >= 3
    vocab = som.vocab_size
    drafts = [words[0], words[1], 7]  # 7 is not the next word
    mask = som.grammar_bitmask([r], [1], [drafts], 5)
    assert len(allowed(mask[0], vocab)) == vocab  # an unconstrained row before it
    for row, word in ((1, words[0]), (2, words[1]), (3, words[2])):  # after 0, 1, 2 drafts
        ok = allowed(mask[row], vocab)
        assert word in ok and len(ok) < 20, (row, word, ok)  # the text's next pieces only
    assert words[1] not in allowed(mask[1], vocab) and words[0] not in allowed(mask[2], vocab)
    assert len(allowed(mask[4], vocab)) == vocab  # after the refused draft: left as is
    again = som.grammar_bitmask([r], [0], [[]], 1)  # nothing was consumed
    np.testing.assert_array_equal(again[0], mask[1])
    assert som.valid_drafts(r, drafts) == words[:2]
    assert som.valid_drafts(r, [7, words[0]]) == []
    assert som.valid_drafts(req("free"), [7, 8]) == [7, 8]
