"""Prompt embeddings (--enable-prompt-embeds): a prompt sent as its token embeddings gives the
token prompt's tokens and logprobs, mixed with token prompts in one batch, on the Python API
and over /v1/completions (base64 of a torch.save'd tensor, read without unpickling code:
openai/test_prompt_embeds_archive.py); what they cannot be used with, or more positions than
max_model_len, is refused by name."""

import base64
import io

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.entrypoints.test_classify_score import post_all
from tests.helpers import make_tiny_hf

IDS = [[5, 17, 42, 8, 99, 3], [7, 7, 120, 64] + list(range(1, 37))]  # 40: chunked by 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def table(model_dir) -> np.ndarray:
    """The model's input embedding table [V, D]."""
    return load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def llm(model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")  # (the HTTP test serves its engine core)
    llm = LLM(str(model_dir), max_model_len=64, max_num_batched_tokens=32,
              enable_prompt_embeds=True)  # fmt: skip
    mp.undo()
    yield llm
    llm.llm_engine.shutdown()


def tokens_and_logprobs(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outputs]


def test_embeddings_give_the_token_prompts_output_mixed_in_a_batch(llm, table):
    expected = tokens_and_logprobs(llm.generate([{"prompt_token_ids": i} for i in IDS], GREEDY))
    prompts = [{"prompt_embeds": table[IDS[0]]}, {"prompt_token_ids": IDS[1]},
               {"prompt_embeds": torch.from_numpy(table[IDS[1]])}]  # fmt: skip
    got = tokens_and_logprobs(llm.generate(prompts, GREEDY))
    for (tokens, lp), (want, want_lp) in zip(
        got, [expected[0], expected[1], expected[1]], strict=True
    ):
        assert tokens == want and lp == pytest.approx(want_lp, abs=1e-4)
    # the same embeddings again: their blocks come from the prefix cache, same output
    again = llm.generate([{"prompt_embeds": table[IDS[1]]}], GREEDY)
    ((tokens, lp),) = tokens_and_logprobs(again)
    assert again[0].num_cached_tokens == 32 and tokens == expected[1][0]
    assert lp == pytest.approx(expected[1][1], abs=1e-4)


def test_what_prompt_embeddings_cannot_be_used_with_is_refused_by_name(llm, table, model_dir):
    with pytest.raises(ValueError, match=r"must be \[positions, 64\].*got shape \[3, 7\]"):
        llm.generate({"prompt_embeds": np.zeros((3, 7))}, GREEDY)
    with pytest.raises(ValueError, match="finite"):
        llm.generate({"prompt_embeds": np.full((3, 64), np.nan)}, GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs cannot be used with prompt_embeds"):
        llm.generate({"prompt_embeds": table[IDS[0]]}, SamplingParams(prompt_logprobs=1))
    plain = LLM(str(model_dir), max_model_len=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        plain.generate({"prompt_embeds": table[IDS[0]]}, GREEDY)
    plain.llm_engine.shutdown()
    assert len(llm.generate({"prompt_token_ids": IDS[0]}, GREEDY)[0].outputs[0].token_ids) == 8


def saved(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_completions_take_base64_prompt_embeds_beside_token_prompts(llm, table):
    body = {
        "model": "m",
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }  # (the tiny model has no tokenizer)
    token, embeds, refused, echo, expanded, long = post_all(llm, [
        ("/v1/completions", {**body, "prompt": IDS[0]}),
        ("/v1/completions", {**body, "prompt": [IDS[1]], "prompt_embeds": saved(
            torch.from_numpy(table[IDS[0]]))}),
        ("/v1/completions", {**body, "prompt_embeds": ["eA=="]}),
        ("/v1/completions", {**body, "prompt_embeds": saved(torch.from_numpy(table[IDS[0]])),
                             "echo": True}),
        # stride 0: 1 KB that would be 51 MB as an array; more positions than max_model_len
        ("/v1/completions", {**body, "prompt_embeds": saved(torch.zeros(1).expand(200000, 64))}),
        ("/v1/completions", {**body, "prompt_embeds": saved(torch.zeros(65, 64))}),
    ])  # fmt: skip
    assert token.status_code == embeds.status_code == 200, embeds.text
    choices = embeds.json()["choices"]  # the token prompts first, then the embeddings
    assert [c["index"] for c in choices] == [0, 1]
    want = token.json()["choices"][0]["logprobs"]
    assert choices[1]["logprobs"]["tokens"] == want["tokens"] and len(want["tokens"]) == 8
    assert choices[1]["logprobs"]["token_logprobs"] == pytest.approx(want["token_logprobs"],
                                                                      abs=1e-4)  # fmt: skip
    assert refused.status_code == 400 and "prompt_embeds" in refused.json()["error"]["message"]
    assert echo.status_code == 400 and "echo cannot be used" in echo.json()["error"]["message"]
    assert expanded.status_code == long.status_code == 400
    assert "got shape (200000, 64)" in expanded.json()["error"]["message"]
    assert (
        "1 to 64 positions (max_model_len), got shape (65, 64)" in long.json()["error"]["message"]
    )
