"""Each input-batch row's sampling parameters as arrays, written once when its request is added
(vLLM V1 keeps them in its InputBatch the same way), so a step's sampling inputs are a gather
of its rows, never a loop over their SamplingParams.

allowed_token_ids and bad_words end in the step's token bitmask (the structured-output mask,
i32[S, ceil(V/32)]): a row's allowed tokens less its one-token bad words are a fixed mask; a
longer bad word blocks its last token only where the outputs before end with its other tokens,
which the host knows only once every earlier step is processed: a step with such a row samples
late, as a grammar's does (`blocked_bitmask`). vLLM applies both after the raw logprobs; here the
logprobs, as with a grammar, see them."""

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
        # allowed_token_ids / bad_words: which rows have a fixed mask, which longer bad words
        self.masked = np.zeros(r, bool)
        self.has_bad_words = np.zeros(r, bool)
        self._mask_ids: dict[int, tuple[list[int] | None, list[int]]] = {}  # (allowed, blocked)
        self._masks: dict[int, np.ndarray] = {}  # built on first use: u32[ceil(V/32)]
        self._bad_words: dict[int, list[tuple[list[int], int]]] = {}  # [(prefix, last)]

    def add(self, row: int, p: SamplingParams, eos_token_id: int | None) -> None:
        c = self.columns
        # (a top_k at or past the vocabulary arrives as 0, no filter: the InputProcessor's)
        c["temperature"][row], c["top_k"][row] = p.temperature, p.top_k
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
        self._add_masks(row, p)

    def _add_masks(self, row: int, p: SamplingParams) -> None:
        self._masks.pop(row, None)
        words = p.bad_words_token_ids or []
        single = [w[0] for w in words if len(w) == 1]
        self.masked[row] = p.allowed_token_ids is not None or bool(single)
        if self.masked[row]:
            self._mask_ids[row] = (p.allowed_token_ids, single)
        longer = [(w[:-1], w[-1]) for w in words if len(w) > 1]
        self.has_bad_words[row] = bool(longer)
        self._bad_words[row] = longer

    def _mask(self, row: int, num_words: int) -> np.ndarray:
        """The row's fixed mask, i32[num_words]: its allowed tokens less its blocked ones."""
        if row not in self._masks:
            allowed, blocked = self._mask_ids[row]
            bits = np.full(num_words * 32, allowed is None)
            if allowed is not None:
                bits[allowed] = True
            bits[blocked] = False
            packed = np.packbits(bits, bitorder="little")  # bit t % 8 of byte t // 8
            self._masks[row] = packed.view("<i4").astype(np.int32)  # bit t % 32 of word t // 32
        return self._masks[row]

    def blocked_bitmask(
        self,
        md: SamplingMetadata,
        rows: np.ndarray,
        n: int,
        grammar: np.ndarray | None,
        token_ids: np.ndarray,
        num_prompt_tokens: np.ndarray,
    ) -> np.ndarray | None:
        """A late-sampled step's token bitmask, i32[s, ceil(V/32)]: the fixed masks (md's),
        the grammars' rows (grammar: i32[<= n, ceil(V/32)] or None) and each longer bad word's
        last token where the outputs before end with its other tokens (token_ids: i32[R, L],
        every earlier step's tokens known; rows: i32[s] input-batch rows, the first n real).
        None when neither a grammar nor a bad word applies."""
        blocks = []
        positions = md.output_positions
        for i in np.flatnonzero(self.has_bad_words[rows[:n]]):
            row, p = int(rows[i]), int(positions[i])
            outputs = token_ids[row, num_prompt_tokens[row] : num_prompt_tokens[row] + p]
            for prefix, last in self._bad_words[row]:
                if len(prefix) <= p and outputs[p - len(prefix) :].tolist() == prefix:
                    blocks.append((i, last))
        if grammar is None and not blocks:
            return None
        bitmask = md.token_bitmask.copy()
        if grammar is not None:
            bitmask[: grammar.shape[0]] &= grammar
        words = bitmask.view(np.uint32)
        for i, token in blocks:
            words[i, token // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (token % 32)))
        return bitmask

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
        masked = np.flatnonzero(self.masked[rows])
        if masked.size:  # allowed_token_ids, one-token bad words
            token_bitmask = token_bitmask.copy()
            for i in masked:
                token_bitmask[i] &= self._mask(int(rows[i]), token_bitmask.shape[1])
        md = SamplingMetadata(
            **padded,
            prompt_mask=None,
            output_counts=None,
            bias_token_ids=bias_ids,
            bias_values=bias_values,
            output_positions=out_pos,
            token_bitmask=token_bitmask,
        )
        variant = SamplerVariant.of_rows(
            padded["temperature"][:n],
            padded["top_k"][:n],
            padded["top_p"][:n],
            padded["min_p"][:n],
            penalties=self.penalised[rows],
            bias=(bias_ids[:n] >= 0).any(axis=1),
            logprobs=self.logprobs[rows],
        )
        return md, variant._replace(structured=bool(masked.size))


def _write_bias(ids: np.ndarray, values: np.ndarray, bias: dict[int, float]) -> None:
    """One row of a sparse bias: ids i32[B] (-1 past the entries), values f32[B]."""
    ids[:] = -1
    values[:] = 0.0
    ids[: len(bias)] = list(bias)
    values[: len(bias)] = list(bias.values())
