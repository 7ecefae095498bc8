"""LLM.generate / LLM.chat end to end (fp32, CPU): against HF on the default model, and the
engine's own behaviours (chunking, preemption, async scheduling, aborts, stop strings, seeds,
structured outputs, compilation) on a tiny random model with a byte-level tokenizer, whose
steps cost ~1/70 of the default model's (64 greedy steps of 4 rows: 0.13 s, 9.3 s)."""

import pytest
import torch

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.worker.executables import num_compilations
from tests.helpers import (
    core_of,
    drain_engine,
    engines_in_process,
    hf_default_model,
    hf_model,
    make_tiny_hf,
    make_tiny_tokenizer,
)

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three colours."}],
]
RAW = ["The quick brown fox", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)


@pytest.fixture(scope="module", autouse=True)
def share_loaded_model():
    """The core in this process (the tests look inside it), and one model load for the
    module: every LLM below differs only in engine settings."""
    with engines_in_process():
        yield


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random llama with a byte-level tokenizer (ChatML, <|endoftext|> its EOS):
    what the engine does with tokens (chunks, preemption, async steps, aborts) any model
    shows, and its steps (sampling over 259 tokens, not 49152) cost next to nothing."""
    out = tmp_path_factory.mktemp("tiny")
    vocab = make_tiny_tokenizer(out)
    return make_tiny_hf(
        "llama",
        out,
        vocab_size=vocab,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        eos_token_id=vocab - 3,
    )


def tiny_llm(tiny_dir, **engine):
    return LLM(str(tiny_dir), **engine)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The tiny model's engine with `llm`'s settings: the reference of `chunked`."""
    return tiny_llm(tiny_dir, **SMALL)


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    return hf_model(str(tiny_dir))


# The tiny model's second engine: every prompt split into 16-token chunks, no prefix caching,
# and 15 usable KV blocks of 16 tokens (long generations preempt each other), with async
# scheduling (off by default on CPU): one engine for chunking, preemption and aborts.
CHUNKED = {**SMALL, "max_num_batched_tokens": 16, "enable_prefix_caching": False,
           "num_gpu_blocks_override": 16}  # fmt: skip


@pytest.fixture(scope="module")
def chunked(tiny_dir):
    return tiny_llm(tiny_dir, **CHUNKED, async_scheduling=True)


@pytest.fixture(scope="module")
def tiny_pool(chunked):
    return chunked


@pytest.fixture(scope="module")
def hf():
    return hf_default_model()


def prompt_ids(llm):
    tok = llm.get_tokenizer()
    chats = [
        tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False).input_ids
        for c in CHATS
    ]  # fmt: skip
    return chats + [tok(p).input_ids for p in RAW]


def core(llm):
    """The EngineCore behind the LLM's in-process client."""
    return core_of(llm)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def greedy(llm):
    """The GREEDY tokens of prompt_ids, batched on `llm`, the first time `llm` sees them (no
    prefix cache hit): the reference the tests below compare other runs with."""
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompt_ids(llm)], GREEDY))


def hf_greedy(hf, prompts, eos, pad, **kwargs):
    """HF's greedy generate of each prompt, up to its EOS, in one batch: the prompts
    left-padded with `pad`, masked out (one generate per prompt gives the same tokens, checked
    when written, in twice the time). Logits processors read the padding: a repetition
    penalty's `pad` must be a token of every prompt."""
    width = max(map(len, prompts))
    padded = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.no_grad():
        out = hf.generate(padded, attention_mask=mask, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos, **kwargs)[:, width:].tolist()  # fmt: skip
    return [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in out]  # EOS, then pads


def test_greedy_matches_hf_token_for_token(llm, hf, greedy):
    eos = llm.get_tokenizer().eos_token_id
    assert greedy == hf_greedy(hf, prompt_ids(llm), eos, pad=eos, max_new_tokens=32)


def test_chat_and_generate_shapes(llm):
    out = llm.chat(CHATS[0], GREEDY)[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    assert out.finished and out.prompt.startswith("<|im_start|>")
    outs = llm.generate(["Hello", {"prompt": "Hi there"}], SamplingParams(max_tokens=3, seed=1))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_same_tokens_whatever_the_chunking_preemption_and_prefix_cache(tiny, tiny_pool):
    """Prefix-cached or not, chunked (16-token chunks) and preempted or not, with penalties:
    the same tokens. (Greedy rows in another batch: test_structured_outputs_constrain_their_
    rows_only; a seeded row alone or not: test_seeded_sampling_reproduces_whatever_the_batch;
    chunked and async without penalties: test_async_scheduling_gives_what_synchronous_...)"""
    llm = tiny
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(llm)]
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)  # the prompts' blocks are cached now
    assert token_ids(again) == token_ids(first)
    assert all(o.num_cached_tokens > 0 for o in again[:3])
    # chunked, preempted and resumed: a resumed row's penalty state is rebuilt from prompt +
    # output
    long = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=1.2,
                          frequency_penalty=0.5, presence_penalty=0.5)  # fmt: skip
    out = tiny_pool.generate(prompts, long)
    assert core(tiny_pool).scheduler.total_preemptions > 0
    assert token_ids(out) == token_ids(llm.generate(prompts, long))
    core(tiny_pool).scheduler.kv_cache_manager.check_no_leaks()


def test_stop_strings_and_n_drain_clean(tiny):
    llm = tiny
    text = llm.chat(CHATS[1], GREEDY)[0].outputs[0].text
    stop = text[5:9]  # a stop string inside the greedy answer, likely spanning tokens
    out = llm.chat(CHATS[1], SamplingParams(temperature=0.0, max_tokens=32, stop=[stop]))[0]
    assert out.outputs[0].text == text[: text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    incl = SamplingParams(temperature=0.0, max_tokens=32, stop=[stop],
                          include_stop_str_in_output=True)  # fmt: skip
    assert llm.chat(CHATS[1], incl)[0].outputs[0].text == text[: text.index(stop) + len(stop)]
    three = llm.generate("Once upon a time", SamplingParams(n=3, max_tokens=8, seed=7))[0]
    assert [c.index for c in three.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in three.outputs}) > 1
    core(llm).scheduler.kv_cache_manager.check_no_leaks()
    assert not core(llm).has_unfinished_requests()


def test_delta_outputs_concatenate_without_replacement_chars(llm):
    from jaxserve.engine.output_processor import OutputProcessor
    from jaxserve.ipc.messages import EngineCoreOutput, EngineCoreRequest

    tok = llm.get_tokenizer()
    text = "日本語のテキスト 🙂🎉 and ascii"
    ids = tok(text, add_special_tokens=False).input_ids
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)
    proc.add_request(None, EngineCoreRequest("r", [1], params, None, 0.0))

    pieces = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        outs, _ = proc.process_outputs(
            [EngineCoreOutput("r", [t], finish_reason="length" if last else None)]
        )
        pieces.append(outs[0].outputs[0].text)
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_no_compilation_after_warmup(tiny):
    """Batch sizes, prompt lengths and sampling parameters mixed: no step compiles (the step
    shapes are the engine settings', `llm`'s here, whatever the model)."""
    llm = tiny
    compiled = num_compilations()
    mixes = [
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=7, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5,
                       repetition_penalty=1.2, max_tokens=4, logprobs=5, prompt_logprobs=2),
        SamplingParams(temperature=0.7, logit_bias={42: 5.0}, min_tokens=3, max_tokens=6),
    ]  # fmt: skip
    words = [
        "a",
        "longer",
        "prompt",
        "with",
        "several",
        "more",
        "words",
        "in",
        "it",
        "than",
        "the",
        "first",
        "one",
        "has",
    ]
    for k in range(1, 6):  # batch sizes 1..9, prompt lengths 1..13, parameters mixed
        prompts = [" ".join(words[: 1 + (i * 5 + k) % 13]) for i in range(2 * k - 1)]
        llm.generate(prompts, [mixes[(i + k) % 4] for i in range(len(prompts))])
    assert num_compilations() == compiled


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": []}, GREEDY, "prompt must not be empty"),
        ({"prompt_token_ids": [1, 10**6]}, GREEDY, "token id 1000000 is out of vocabulary"),
        ({"prompt_token_ids": [5] * 600}, GREEDY, "maximum context length is 512 tokens"),
        ("hi", SamplingParams(max_tokens=600), "max_completion_tokens' is too large: 600"),
        ("hi", SamplingParams(logprobs=21), "logprobs=21 exceeds max_logprobs=20"),
        ("hi", SamplingParams(prompt_logprobs=21), "prompt_logprobs=21 exceeds max_logprobs=20"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias: token id 1000000"),
        (
            "hi",
            SamplingParams(logit_bias={i: 1.0 for i in range(100, 164)}, min_tokens=1),
            "logit_bias has 64 entries and min_tokens blocks 1 stop tokens",
        ),
    ],
)
def test_bad_inputs_fail_alone(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert token_ids(llm.generate(["ok"], SamplingParams(max_tokens=2, temperature=0))) != [[]]
    core(llm).scheduler.kv_cache_manager.check_no_leaks()


def test_seeded_sampling_reproduces_whatever_the_batch(tiny):
    llm = tiny
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=8, logprobs=3)
    alone = llm.generate(["Tell me a story"], seeded)[0].outputs[0]
    others = [SamplingParams(max_tokens=5), seeded, SamplingParams(temperature=0.5, max_tokens=3)]
    mixed = llm.generate(["other prompt", "Tell me a story", "x y z"], others)[1].outputs[0]
    assert alone.token_ids == mixed.token_ids
    reseeded = SamplingParams(temperature=1.0, seed=124, max_tokens=8)
    assert llm.generate(["Tell me a story"], reseeded)[0].outputs[0].token_ids != alone.token_ids
    sampled = [pos[t].logprob for t, pos in zip(alone.token_ids, alone.logprobs, strict=True)]
    assert all(len(pos) >= 3 for pos in alone.logprobs)
    assert alone.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-4)


def test_logprobs_match_hf(llm, hf):
    ids = prompt_ids(llm)[0]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1,
                                                                   logprobs=5))[0]  # fmt: skip
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1).numpy()
    position = out.outputs[0].logprobs[0]
    top5 = ref.argsort()[::-1][:5].tolist()
    assert set(top5) <= set(position) and out.outputs[0].token_ids == [top5[0]]
    for token_id, lp in position.items():
        assert lp.logprob == pytest.approx(float(ref[token_id]), abs=1e-2)
    assert position[top5[0]].rank == 1


def test_prompt_logprobs_match_hf_across_chunks(llm, hf, chunked, tiny_hf):
    asks = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    two = SamplingParams(temperature=0, max_tokens=2)
    for engine, model in ((llm, hf), (chunked, tiny_hf)):
        ids = prompt_ids(engine)[1]  # a chat prompt of 30+ tokens: 16-token chunks in `chunked`
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()  # [n, V]
        out, other = engine.generate([{"prompt_token_ids": ids}, "another prompt"], [asks, two])
        assert other.prompt_logprobs is None
        positions = out.prompt_logprobs
        assert len(positions) == len(ids) and positions[0] is None
        for p in range(1, len(ids)):
            scores, target = ref[p - 1], ids[p]  # position p is scored by the logits at p - 1
            entry = positions[p]
            assert entry[target].logprob == pytest.approx(float(scores[target]), abs=1e-3)
            top3 = scores.argsort()[::-1][:3].tolist()
            assert set(top3) <= set(entry) and len(entry) in (3, 4)
            assert [entry[t].rank for t in top3] == [1, 2, 3]
            assert entry[target].rank == 1 + int((scores > scores[target]).sum())
        assert out.outputs[0].token_ids == token_ids(engine.generate([{"prompt_token_ids": ids}],
                                                                     two))[0]  # fmt: skip
    core(chunked).scheduler.kv_cache_manager.check_no_leaks()


def test_mixed_workload_with_aborts_drains_to_an_empty_pool(tiny, tiny_pool):
    """Aborts (waiting and running), stop strings, n=3 and preemption in one run; afterwards
    no request is held, every block but the null block is free and every ref count is 0."""
    count = "Count: one, two, three,"
    whole = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    text = tiny.generate(count, whole)[0].outputs[0].text
    stop = text[10:13]  # a stop string inside the greedy answer (a random model's)
    engine, sched = tiny_pool.llm_engine, core(tiny_pool).scheduler
    preemptions = sched.total_preemptions
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i, topic in enumerate(["sea", "sky", "moon", "forest"]):  # 4 x 4 blocks + the rest > 15
        engine.add_request(f"long-{i}", f"Tell me everything about the {topic}.", long)
    engine.add_request("n3", "Once upon a time", SamplingParams(n=3, max_tokens=40, seed=1))
    engine.add_request(
        "stop", count, SamplingParams(temperature=0.0, max_tokens=60, stop=[stop], ignore_eos=True)
    )
    engine.add_request("to-abort-running", "Say something long.", long)
    finished = {}
    for _ in range(3):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "to-abort-running" in sched.requests
    engine.add_request("to-abort-waiting", "Never runs.", long)
    engine.abort_request(["to-abort-running", "to-abort-waiting", "unknown-id"])
    drain_engine(engine, finished)
    assert set(finished) == {"long-0", "long-1", "long-2", "long-3", "n3", "stop"}
    assert len(finished["n3"].outputs) == 3
    assert finished["stop"].outputs[0].stop_reason == stop
    assert finished["stop"].outputs[0].text == text[: text.index(stop)]
    assert sched.total_preemptions > preemptions
    assert not sched.requests and not sched.running and not len(sched.waiting)
    kv = sched.kv_cache_manager
    assert not kv.req_to_blocks
    assert kv.block_pool.get_num_free_blocks() == core(tiny_pool).num_blocks - 1
    kv.check_no_leaks()


def test_repetition_penalty_matches_hf_chunked_or_not(llm, hf, greedy, chunked, tiny_hf):
    """The device-resident penalty state (prompt mask + output counts per row) against HF's
    RepetitionPenaltyLogitsProcessor, greedy, with prompts chunked (the tiny model's `chunked`)
    or not (through preemption: test_same_tokens_whatever_the_chunking_preemption_and_...)."""
    prompts = prompt_ids(llm)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.5)
    eos = llm.get_tokenizer().eos_token_id
    pad = prompts[0][0]  # <|im_start|>, in every chat prompt: a padding the penalty ignores
    assert all(pad in ids for ids in prompts)
    refs = hf_greedy(hf, prompts, eos, pad, max_new_tokens=24, repetition_penalty=1.5)
    assert refs != [ids[:24] for ids in greedy[:3]]  # the penalty changes the greedy tokens
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert token_ids(got) == refs
    prompts = prompt_ids(chunked)[:3]
    eos = chunked.get_tokenizer().eos_token_id
    pad = prompts[0][0]  # ChatML's <|im_start|> too
    assert all(pad in ids for ids in prompts)
    tiny_refs = hf_greedy(tiny_hf, prompts, eos, pad, max_new_tokens=24, repetition_penalty=1.5)
    plain = hf_greedy(tiny_hf, prompts, eos, pad, max_new_tokens=24)
    assert tiny_refs != plain
    got = chunked.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert token_ids(got) == tiny_refs


def test_async_scheduling_gives_what_synchronous_scheduling_gives(tiny, tiny_pool):
    """Scheduling step N+1 while step N runs changes no request's tokens or logprobs:
    greedy, seeded sampling, penalties, stop tokens, min_tokens, max_tokens=1, through
    preemption; and it compiles nothing new. The synchronous engine is `tiny` (unchunked, a
    large pool: tokens do not depend on either, test_same_tokens_whatever_the_chunking_...)."""
    sync = tiny
    assert core(tiny_pool).max_in_flight == 2 and core(sync).max_in_flight == 1
    eos = tiny_pool.get_tokenizer().eos_token_id
    mixes = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=7, max_tokens=28, logprobs=1),
        SamplingParams(temperature=0.8, seed=8, max_tokens=24, repetition_penalty=1.3,
                       frequency_penalty=0.4, min_tokens=16, stop_token_ids=[eos]),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(tiny_pool)] * 2
    params = [mixes[i % len(mixes)] for i in range(len(prompts))]
    compiled = num_compilations()
    preemptions = core(tiny_pool).scheduler.total_preemptions
    got, want = tiny_pool.generate(prompts, params), sync.generate(prompts, params)
    assert core(tiny_pool).scheduler.total_preemptions > preemptions
    assert token_ids(got) == token_ids(want)
    for g, w in zip(got, want, strict=True):
        g, w = g.outputs[0], w.outputs[0]
        assert g.finish_reason == w.finish_reason
        if w.logprobs is not None:
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert num_compilations() == compiled
    for engine in (tiny_pool, sync):
        assert engine.llm_engine.engine_core.call_utility("get_state")["num_requests"] == 0


# ---------------------------------------------------------------------- structured outputs
PERSON = {  # OpenAI strict-mode style: every property required, no others
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "student": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["name", "age", "height", "student", "color", "hobbies"],
    "additionalProperties": False,
}


# The tiny model's tokens are bytes, and it samples at random: a schema of bounded fields in
# compact JSON fits its 200 tokens (at most ~90; PERSON's numbers and strings may not).
TINY_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "student": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "student", "color", "tags"],
    "additionalProperties": False,
}


def test_structured_outputs_constrain_their_rows_only(tiny):
    """Constrained rows (json, regex, choice, grammar) beside free ones in one batch: each
    constrained output matches, the free rows keep their greedy tokens, nothing compiles.
    (On the default model, through the server: tests/entrypoints/openai/
    test_structured_outputs.py.)"""
    import json
    import re

    import jsonschema

    from jaxserve.sampling_params import StructuredOutputsParams as SO

    llm = tiny
    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    free = [{"prompt_token_ids": p} for p in prompt_ids(llm)[:3]]
    alone = token_ids(llm.generate(free, GREEDY))  # the free rows in a batch of their own
    llm.generate(chat, SamplingParams(max_tokens=2, structured_outputs=SO(choice=["a"])))
    compiled = num_compilations()  # the first constrained request built the backend

    def constrained(so, **kw):
        return SamplingParams(temperature=1.0, max_tokens=200, structured_outputs=so, **kw)

    cases = [
        (constrained(SO(json=TINY_PERSON, disable_any_whitespace=True), seed=1), None),
        (constrained(SO(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}")), r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        (constrained(SO(choice=["sunny", "rainy", "cloudy"])), r"sunny|rainy|cloudy"),
        (constrained(SO(grammar='root ::= "yes" | "no"')), r"yes|no"),
        (constrained(SO(json=json.dumps(TINY_PERSON), disable_any_whitespace=True), seed=2), None),
    ]
    prompts = [chat] * len(cases) + free
    params = [c[0] for c in cases] + [GREEDY] * len(free)
    outs = llm.generate(prompts, params)
    for (_, pattern), out in zip(cases, outs, strict=False):
        text = out.outputs[0].text
        if pattern is None:
            jsonschema.validate(json.loads(text), TINY_PERSON)
        else:
            assert re.fullmatch(pattern, text), text
        assert out.outputs[0].finish_reason == "stop"
    assert token_ids(outs[len(cases) :]) == alone
    assert num_compilations() == compiled
    core(llm).scheduler.kv_cache_manager.check_no_leaks()


def test_json_schema_valid_when_sampled_with_async_scheduling_and_preemption(tiny_pool):
    """Sampled requests at temperature 1.0 (async scheduling: each step's bitmask waits for
    the step before it; a small KV pool: preemptions) all give JSON that validates."""
    import json

    import jsonschema

    from jaxserve.sampling_params import StructuredOutputsParams as SO

    so = SO(json=TINY_PERSON, disable_any_whitespace=True)
    params = SamplingParams(temperature=1.0, max_tokens=200, structured_outputs=so)
    preemptions = core(tiny_pool).scheduler.total_preemptions
    outs = tiny_pool.chat([[{"role": "user", "content": "A person, as JSON."}]] * 3, params)
    assert core(tiny_pool).scheduler.total_preemptions > preemptions
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), TINY_PERSON)
    assert len({o.outputs[0].text for o in outs}) == 3  # sampled, not one answer
    core(tiny_pool).scheduler.kv_cache_manager.check_no_leaks()


def test_bad_constraints_fail_alone_before_queueing(llm):
    from jaxserve.sampling_params import StructuredOutputsParams as SO

    with pytest.raises(ValueError, match="exactly one of"):
        SO(regex="a", choice=["a"])
    for so, message in [
        (SO(regex="a[b"), "unclosed character class"),
        (SO(json={"type": "objekt"}), "Invalid type: objekt"),
        (SO(json="{not json"), "Invalid JSON grammar specification"),
        (SO(grammar="start: y"), 'unknown name: "y"'),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate("hi", SamplingParams(structured_outputs=so))
    assert not core(llm).has_unfinished_requests()
