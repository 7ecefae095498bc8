"""Each input-batch row's sampling parameters as arrays, written once when its request is added
(vLLM V1 keeps them in its InputBatch the same way), so a step's sampling inputs are a gather
of its rows, never a loop over their SamplingParams."""

from __future__ import annotations

import numpy as np

from jaxserve.layers.sampler import SamplerVariant, SamplingMetadata, is_penalised
from jaxserve.sampling_params import MAX_BIAS_TOKENS, SamplingParams

# Each per-row array and the value a padding row (greedy, no filter, no penalty) has.
_COLUMNS = {
    "temperature": (np.float32, 0.0),
    "top_k": (np.int32, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "presence_penalty": (np.float32, 0.0),
    "frequency_penalty": (np.float32, 0.0),
    "repetition_penalty": (np.float32, 1.0),
    "seeds": (np.uint32, 0),  # a 64-bit seed's low word
    "seeds_hi": (np.uint32, 0),  # its high word
    "has_seed": (bool, False),
}


class SamplingRows:
    """Arrays of R = max_num_reqs rows; a row's values are its request's while it holds it."""

    def __init__(self, max_num_reqs: int):
        r, b = max_num_reqs, MAX_BIAS_TOKENS
        self.columns = {name: np.full(r, fill, dtype) for name, (dtype, fill) in _COLUMNS.items()}
        self.min_tokens = np.zeros(r, np.int32)
        self.penalised = np.zeros(r, bool)  # repetition, frequency or presence penalty
        self.logprobs = np.zeros(r, bool)  # asked for sampled-token logprobs
        self.prompt_logprobs = np.zeros(r, bool)
        # The sparse logit bias [R, B] (-1: unused slot), and the same with EOS and the stop
        # tokens at -inf, which a row takes while it has fewer than min_tokens outputs.
        self.bias_ids = np.full((r, b), -1, np.int32)
        self.bias_values = np.zeros((r, b), np.float32)
        self.blocked_ids = np.full((r, b), -1, np.int32)
        self.blocked_values = np.zeros((r, b), np.float32)

    def add(self, row: int, p: SamplingParams, eos_token_id: int | None) -> None:
        c = self.columns
        # A top_k at or past the vocabulary is no filter (the InputProcessor sets 0 for it).
        c["temperature"][row], c["top_k"][row] = p.temperature, min(p.top_k, 2**31 - 1)
        c["top_p"][row], c["min_p"][row] = p.top_p, p.min_p
        c["presence_penalty"][row] = p.presence_penalty
        c["frequency_penalty"][row] = p.frequency_penalty
        c["repetition_penalty"][row] = p.repetition_penalty
        seed = 0 if p.seed is None else p.seed % 2**64  # two's complement of a negative seed
        c["seeds"][row], c["seeds_hi"][row] = seed & 0xFFFFFFFF, seed >> 32
        c["has_seed"][row] = p.seed is not None
        self.min_tokens[row] = p.min_tokens
        self.penalised[row] = is_penalised(p)
        self.logprobs[row] = p.logprobs is not None
        self.prompt_logprobs[row] = p.prompt_logprobs is not None
        bias = dict(p.logit_bias or {})
        _write_bias(self.bias_ids[row], self.bias_values[row], bias)
        if p.min_tokens:  # EOS and stop tokens may not end it yet
            stops = [
                *([eos_token_id] if eos_token_id is not None else []),
                *(p.stop_token_ids or []),
            ]
            bias.update(dict.fromkeys(stops, -np.inf))
        _write_bias(self.blocked_ids[row], self.blocked_values[row], bias)

    def metadata(
        self, rows: np.ndarray, output_positions: np.ndarray, s: int, token_bitmask: np.ndarray
    ) -> tuple[SamplingMetadata, SamplerVariant]:
        """The sampling arrays of `rows` (i32[n], host rows; a row may repeat: one per draft
        position) padded to s rows, and the passes they need. output_positions: i32[n], the
        outputs before each row's sampled token (min_tokens' blocks hold while it is below);
        token_bitmask: i32[s, ceil(V/32)], every token allowed (a step's grammar masks are
        added later). prompt_mask / output_counts are None: the step reads them on the
        device."""
        n = len(rows)
        padded = {}
        for name, (dtype, fill) in _COLUMNS.items():
            padded[name] = np.full(s, fill, dtype)
            padded[name][:n] = self.columns[name][rows]
        out_pos = np.zeros(s, np.int32)
        out_pos[:n] = output_positions
        blocked = (output_positions < self.min_tokens[rows])[:, None]
        bias_ids = np.full((s, MAX_BIAS_TOKENS), -1, np.int32)
        bias_values = np.zeros((s, MAX_BIAS_TOKENS), np.float32)
        bias_ids[:n] = np.where(blocked, self.blocked_ids[rows], self.bias_ids[rows])
        bias_values[:n] = np.where(blocked, self.blocked_values[rows], self.bias_values[rows])
        md = SamplingMetadata(
            **padded, prompt_mask=None, output_counts=None, bias_token_ids=bias_ids,
            bias_values=bias_values, output_positions=out_pos, token_bitmask=token_bitmask,
        )  # fmt: skip
        variant = SamplerVariant.of_rows(
            padded["temperature"][:n], padded["top_k"][:n], padded["top_p"][:n],
            padded["min_p"][:n], penalties=self.penalised[rows],
            bias=(bias_ids[:n] >= 0).any(axis=1), logprobs=self.logprobs[rows],
        )  # fmt: skip
        return md, variant


def _write_bias(ids: np.ndarray, values: np.ndarray, bias: dict[int, float]) -> None:
    """One row of a sparse bias: ids i32[B] (-1 past the entries), values f32[B]."""
    ids[:] = -1
    values[:] = 0.0
    ids[: len(bias)] = list(bias)
    values[: len(bias)] = list(bias.values())
