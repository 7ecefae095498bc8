"""Multi-LoRA serving against HF + PEFT (fp32, CPU): tiny random Llama and Qwen3 models, random
PEFT adapters of different ranks and targets (B non-zero), served through `LLM` with
--enable-lora. Greedy tokens must equal PEFT's greedy choice over the same prefix and every
sampled token's logprob be within 1e-2 of PEFT's."""

import numpy as np
import pytest

from jaxserve.core.request import Request
from jaxserve.entrypoints.llm import LLM
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.executables import num_compilations
from tests.greedy_parity import log_softmax
from tests.helpers import (
    hf_logits,
    hf_model,
    make_tiny_adapter,
    make_tiny_hf,
    peft_model,
    runner_of,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, enable_lora=True,
              max_loras=2, max_lora_rank=8, max_cpu_loras=3)  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 42, 7, 11], [200, 1, 33, 64, 9], [8, 8, 120, 77, 5, 6, 250, 31, 2]]


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The base model and three adapters: rank 4 on every projection, rank 8 with rsLoRA on
    q, v and down only, rank 2 on k, o, gate and up."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf("llama", root / "base")
    adapters = {
        "a4": make_tiny_adapter(base, root / "a4", r=4, seed=1),
        "a8": make_tiny_adapter(
            base,
            root / "a8",
            r=8,
            seed=2,
            rslora=True,
            alpha=8.0,
            targets=("q_proj", "v_proj", "down_proj"),
        ),  # fmt: skip
        "a2": make_tiny_adapter(
            base, root / "a2", r=2, seed=3, targets=("k_proj", "o_proj", "gate_proj", "up_proj")
        ),  # fmt: skip
    }
    return base, adapters


@pytest.fixture(scope="module")
def llama_llm(llama):
    with pytest.MonkeyPatch.context() as mp:  # the core in this process, for this module only
        mp.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(str(llama[0]), **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def peft_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The reference's greedy tokens and their logprobs, one full forward per token."""
    tokens, logprobs = list(prompt), []
    for _ in range(n):
        lp = log_softmax(hf_logits(model, tokens)[-1])
        tokens.append(int(lp.argmax()))
        logprobs.append(float(lp[tokens[-1]]))
    return tokens[len(prompt) :], logprobs


def check(outputs, refs):
    """Each output's tokens equal its reference's, logprobs within 1e-2."""
    for out, (want_tokens, want_lp) in zip(outputs, refs, strict=True):
        c = out.outputs[0]
        assert list(c.token_ids) == want_tokens
        got = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        np.testing.assert_allclose(got, want_lp, atol=1e-2)


def requests(adapters, names):
    ids = {"a4": 1, "a8": 2, "a2": 3}
    return [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]


def test_mixed_batch_matches_peft_and_each_alone(llama, llama_llm):
    """Base, a4 and a8 rows in one batch equal PEFT's output for each adapter, and each
    request run alone; a new adapter's first use compiles nothing."""
    base, adapters = llama
    names = [None, "a4", "a8", "a4", "a8", None]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    refs = {None: hf_model(str(base))} | {n: peft_model(base, adapters[n]) for n in ("a4", "a8")}
    want = [peft_greedy(refs[n], p, GREEDY.max_tokens) for n, p in zip(names, prompts, strict=True)]
    before = num_compilations()
    batch = llama_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                               lora_request=requests(adapters, names), use_tqdm=False)  # fmt: skip
    assert num_compilations() == before
    check(batch, want)
    alone = llama_llm.generate({"prompt_token_ids": prompts[2]}, GREEDY, use_tqdm=False,
                               lora_request=requests(adapters, ["a8"])[0])  # fmt: skip
    c, b = alone[0].outputs[0], batch[2].outputs[0]
    assert c.token_ids == b.token_ids
    np.testing.assert_allclose(
        [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
        [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids, strict=True)], atol=1e-5,
    )  # fmt: skip


def test_more_adapters_than_slots_wait_and_evict(llama, llama_llm):
    """Three adapters with two slots: the third waits until a slot frees (at most two in
    the running set), slots are re-filled from the host cache, and every output is right."""
    base, adapters = llama
    names = ["a2", "a4", "a8", "a2"]
    want = [peft_greedy(peft_model(base, adapters[n]), PROMPTS[0], GREEDY.max_tokens)
            for n in names]  # fmt: skip
    outs = llama_llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 4, GREEDY, use_tqdm=False,
                              lora_request=requests(adapters, names))  # fmt: skip
    check(outs, want)
    slots = runner_of(llama_llm).features.lora()
    assert len(set(slots.slot_ids) - {0}) <= 2


def test_reloading_a_name_serves_the_new_weights(llama, llama_llm):
    """A name unloaded and loaded again with other weights (a new id) gives the new
    weights' output: no prefix block of the old load is reused."""
    base, adapters = llama
    prompt = PROMPTS[2] * 3  # several full blocks, cached after the first request
    old, new = (LoRARequest("mine", i, str(adapters[n])) for i, n in ((10, "a4"), (11, "a2")))
    first = llama_llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                               lora_request=old)  # fmt: skip
    llama_llm.llm_engine.remove_lora(10)
    slots = runner_of(llama_llm).features.lora()
    assert 10 not in slots.host and 10 not in slots.slot_ids  # nothing used it any more
    second = llama_llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                                lora_request=new)  # fmt: skip
    check(first, [peft_greedy(peft_model(base, adapters["a4"]), prompt, GREEDY.max_tokens)])
    check(second, [peft_greedy(peft_model(base, adapters["a2"]), prompt, GREEDY.max_tokens)])
    assert len(slots.host) <= ENGINE["max_cpu_loras"]  # unused adapters left the host cache


def test_a_bad_adapter_fails_its_request_alone(llama, llama_llm, tmp_path):
    """A rank above max_lora_rank or a missing path fails that request with the reason;
    the other requests of the batch finish normally."""
    base, adapters = llama
    big = make_tiny_adapter(base, tmp_path / "r16", r=16, seed=4)
    loras = [LoRARequest("big", 20, str(big)), None, LoRARequest("gone", 21, str(tmp_path / "x"))]
    outs = llama_llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, GREEDY, use_tqdm=False,
                              lora_request=loras)  # fmt: skip
    assert outs[0].outputs[0].finish_reason == "error"
    assert "greater than max_lora_rank 8" in str(outs[0].outputs[0].stop_reason)
    assert outs[1].outputs[0].finish_reason == "length"
    assert "no LoRA adapter" in str(outs[2].outputs[0].stop_reason)


def test_block_hashes_separate_adapters_and_loads():
    """Prefix blocks: shared by requests of one adapter load, never across adapters, nor
    across two loads of one name."""
    tokens, params = list(range(40)), SamplingParams(max_tokens=1)

    def hashes(lora):
        return Request("r", tokens, params, eos_token_id=None, block_size=16,
                       lora_request=lora).block_hashes  # fmt: skip

    a1, a1_again = LoRARequest("a", 1, "/p"), LoRARequest("a", 1, "/p")
    assert hashes(a1) == hashes(a1_again)
    assert len({tuple(hashes(x)) for x in (None, a1, LoRARequest("b", 2, "/p"),
                                           LoRARequest("a", 3, "/p"))}) == 4  # fmt: skip
    # every block differs, not only the first
    assert not set(hashes(a1)) & set(hashes(None))


def test_qwen3_and_tensor_parallel_match_peft(tmp_path, monkeypatch):
    """Qwen3 (q/k norms after the adapted projections, head_dim 16) at tp 2: PEFT's output,
    with the products always run (the GPU's way: no branch for steps without adapters)."""
    monkeypatch.setattr("jaxserve.worker.lora_slots.SKIP_IDLE_PLATFORMS", ())
    base = make_tiny_hf("qwen3", tmp_path / "base", head_dim=16, tie_word_embeddings=True)
    adapter = make_tiny_adapter(base, tmp_path / "ad", r=8, seed=5)
    llm = LLM(str(base), **ENGINE, tensor_parallel_size=2)
    lora = LoRARequest("q", 1, str(adapter))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=[lora, None, lora])  # fmt: skip
    ref, plain = peft_model(base, adapter), hf_model(str(base))
    check(outs, [peft_greedy(m, p, GREEDY.max_tokens)
                 for m, p in zip((ref, plain, ref), PROMPTS, strict=True)])  # fmt: skip


def test_lora_refused_where_not_served(tmp_path):
    """LoRA on a mixture of experts is refused by name; a lora_request without
    --enable-lora is refused before it reaches the engine."""
    from jaxserve.engine.arg_utils import EngineArgs

    moe = make_tiny_hf("qwen3_moe", tmp_path / "moe", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32)  # fmt: skip
    with pytest.raises(ValueError, match="LoRA is not supported for Qwen3MoeForCausalLM"):
        EngineArgs(model=str(moe), enable_lora=True).create_engine_config()


def test_speculative_decoding_keeps_the_adapters_output(llama):
    """ngram drafts (from the tokens, not the adapter) verified by the adapted target: the
    output is still PEFT's greedy output."""
    base, adapters = llama
    llm = LLM(str(base), **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    prompt = [9, 4, 7, 9, 4, 7, 9, 4, 7, 9, 4]  # repeats: drafts are proposed
    names = ["a4", None, "a8"]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, GREEDY, use_tqdm=False,
                        lora_request=requests(adapters, names))  # fmt: skip
    refs = [hf_model(str(base)) if n is None else peft_model(base, adapters[n]) for n in names]
    check(outs, [peft_greedy(m, prompt, GREEDY.max_tokens) for m in refs])


def test_adapter_on_a_quantized_base_matches_peft_on_its_weights(tmp_path):
    """A GGUF base kept in its quantized blocks (--quantization gguf) with an adapter: PEFT's
    output on the weights the blocks hold (HF's model holds the rounded ones)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import write_llama_gguf
    from tests.models.test_gguf import KEPT

    hf_dir = make_tiny_hf("llama", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    write_llama_gguf(tmp_path / "tiny.gguf", hf, KEPT)  # hf gets the rounded weights
    adapter = make_tiny_adapter(hf_dir, tmp_path / "ad", r=4, seed=6)
    llm = LLM(str(tmp_path / "tiny.gguf"), quantization="gguf", **ENGINE)
    outs = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("g", 1, str(adapter)))  # fmt: skip
    ref = PeftModel.from_pretrained(hf, adapter).eval()
    check(outs, [peft_greedy(ref, PROMPTS[1], GREEDY.max_tokens)])
