"""LLM.generate / LLM.chat on the default model, end to end (fp32, CPU)."""

import functools

import pytest
import torch

import jaxserve.engine.core as core_module
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers import hf_default_model

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
    """One model load for the module: every LLM below differs only in engine settings."""
    original = core_module.load_model
    core_module.load_model = functools.cache(original)
    yield
    core_module.load_model = original


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


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
    return llm.llm_engine.engine_core.engine_core


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_hf_token_for_token(llm, hf):
    prompts = prompt_ids(llm)
    ours = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))
    eos = llm.get_tokenizer().eos_token_id
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                eos_token_id=eos, pad_token_id=eos,
            )[0, len(ids) :].tolist()  # fmt: skip
        assert got == ref


def test_chat_and_generate_shapes(llm):
    out = llm.chat(CHATS[0], GREEDY)[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    assert out.finished and out.prompt.startswith("<|im_start|>")
    outs = llm.generate(["Hello", {"prompt": "Hi there"}], SamplingParams(max_tokens=3, seed=1))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_same_tokens_whatever_the_batch_chunking_and_prefix_cache(llm):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(llm)]
    batched = token_ids(llm.generate(prompts, GREEDY))
    alone = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts[:2]]
    assert alone == batched[:2]
    again = llm.generate(prompts, GREEDY)  # the prompts' blocks are cached now
    assert token_ids(again) == batched
    assert all(o.num_cached_tokens > 0 for o in again[:3])
    chunked = LLM(**{**SMALL, "max_num_batched_tokens": 16, "enable_prefix_caching": False})
    assert token_ids(chunked.generate(prompts, GREEDY)) == batched
    tiny_pool = LLM(**{**SMALL, "num_gpu_blocks_override": 40})  # 39 usable blocks of 16
    long = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    out = tiny_pool.generate(prompts, long)
    assert core(tiny_pool).scheduler.total_preemptions > 0
    assert token_ids(out) == token_ids(llm.generate(prompts, long))
    core(tiny_pool).scheduler.kv_cache_manager.check_no_leaks()


def test_stop_strings_and_n_drain_clean(llm):
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

    tok = llm.get_tokenizer()
    text = "日本語のテキスト 🙂🎉 and ascii"
    ids = tok(text, add_special_tokens=False).input_ids
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)
    proc.add_request("r", None, [1], params, 0.0)
    from jaxserve.ipc.messages import EngineCoreOutput

    pieces = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        outs, _ = proc.process_outputs(
            [EngineCoreOutput("r", [t], finish_reason="length" if last else None)]
        )
        pieces.append(outs[0].outputs[0].text)
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_no_compilation_after_warmup(llm):
    compiled = core(llm).runner.num_compiled_steps()
    mixes = [
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=7, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5,
                       repetition_penalty=1.2, max_tokens=4, logprobs=5),
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
    assert core(llm).runner.num_compiled_steps() == compiled


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": []}, GREEDY, "prompt must not be empty"),
        ({"prompt_token_ids": [1, 10**6]}, GREEDY, "token id 1000000 is out of vocabulary"),
        ({"prompt_token_ids": [5] * 600}, GREEDY, "maximum context length is 512 tokens"),
        ("hi", SamplingParams(max_tokens=600), "max_tokens=600 is too large"),
        ("hi", SamplingParams(logprobs=21), "logprobs=21 exceeds max_logprobs=20"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias token id 1000000"),
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


def test_seeded_sampling_reproduces_whatever_the_batch(llm):
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
