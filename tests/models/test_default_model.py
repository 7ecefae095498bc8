"""The bundled default model (SmolLM2-135M-Instruct, GGUF Q4_1/Q8_0) against HF transformers.

Both sides dequantise the same GGUF file, so the greedy next token must agree at every position
of real chat prompts and the log-probabilities within 1e-2 (decoding through the engine,
token for token against HF's generate: tests/entrypoints/test_llm.py).
"""

import jax
import numpy as np
import pytest
import torch

from jaxserve.models.loader import load_model
from tests.helpers import PagedSequences, hf_default_model

pytestmark = pytest.mark.slow

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "2+2?"}],
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype="float32")


@pytest.fixture(scope="module")
def hf():
    return hf_default_model()


def test_config_and_tokenizer_come_from_the_gguf(loaded):
    cfg = loaded.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    text = loaded.tokenizer.apply_chat_template(PROMPTS[0], tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text


def test_greedy_tokens_and_logprobs_match_hf(loaded, hf):
    tok = loaded.tokenizer
    prompts = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in PROMPTS
    ]
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    paged = PagedSequences(loaded, num_blocks=64, block_size=16, max_blocks=16)
    ours = paged.step(dict(enumerate(ids)))  # all prompts in one flat batch
    for seq, tokens in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0].numpy()
        ours_lp = np.asarray(jax.nn.log_softmax(ours[seq], axis=-1))
        ref_lp = np.asarray(jax.nn.log_softmax(ref, axis=-1))
        np.testing.assert_array_equal(ours_lp.argmax(-1), ref_lp.argmax(-1))
        np.testing.assert_allclose(ours_lp, ref_lp, atol=1e-2, rtol=0)
