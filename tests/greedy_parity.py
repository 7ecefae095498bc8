"""Greedy decoding through a jaxserve model over a paged KV cache (no engine: no start-up
cost), checked against an HF transformers model fed the same tokens."""

from __future__ import annotations

import numpy as np

from tests.helpers import PagedSequences, hf_logits


def greedy_paged(loaded, prompts: list[list[int]], new_tokens: int, kv_dtype=None):
    """Greedy-decode `prompts` in one batch, new_tokens each: prompt 0 prefilled in two
    chunks, its second beside the others' first decodes. Returns ({seq: prompt + generated
    ids}, {seq: log-probabilities [len - 1, V], the row of every position but the last})."""
    paged = PagedSequences(loaded, kv_dtype=kv_dtype)
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    fed = dict.fromkeys(tokens, 0)  # how many of tokens[i] are in the cache
    rows: dict[int, list[np.ndarray]] = {i: [] for i in tokens}
    chunks = {0: prompts[0][: len(prompts[0]) // 2]} | {i: p for i, p in enumerate(prompts) if i}
    while chunks:
        for seq, logits in paged.step(chunks).items():
            fed[seq] += len(chunks[seq])
            rows[seq].append(logits)
            if fed[seq] == len(tokens[seq]):  # a whole prompt or a decode: the next token
                tokens[seq].append(int(logits[-1].argmax()))
        chunks = {
            i: t[fed[i] :] for i, t in tokens.items() if len(t) - len(prompts[i]) < new_tokens
        }
    return tokens, {seq: log_softmax(np.concatenate(r)) for seq, r in rows.items()}


def assert_greedy_matches_hf(loaded, ref, prompts: list[list[int]], new_tokens: int,
                             atol: float = 1e-2, kv_dtype=None):  # fmt: skip
    """jaxserve's greedy tokens are HF model `ref`'s (each generated token is the argmax of
    HF's logits over the same prefix: HF's own greedy choice), and every log-probability of
    every position (prompt and generated, whole vocabulary) is within atol of HF's. Returns
    `greedy_paged`'s (tokens, log-probabilities) and the largest difference from HF's."""
    tokens, logprobs = greedy_paged(loaded, prompts, new_tokens, kv_dtype)
    worst = 0.0
    for seq, prompt in enumerate(prompts):
        want = log_softmax(hf_logits(ref, tokens[seq][:-1]))
        generated = tokens[seq][len(prompt) :]
        assert want[len(prompt) - 1 :].argmax(-1).tolist() == generated, (seq, tokens[seq])
        worst = max(worst, float(np.abs(logprobs[seq] - want).max()))
    assert worst < atol, worst
    return tokens, logprobs, worst


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., V] logits -> log-probabilities."""
    logits = logits - logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))
