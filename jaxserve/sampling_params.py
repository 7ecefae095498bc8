"""SamplingParams: vLLM's fields, defaults and validation (ValueError naming the field)."""

from __future__ import annotations

import enum
import math

import msgspec


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


_GREEDY_EPS = 1e-5
MAX_N = 128  # completions per request
# B of the sampler's sparse bias arrays: a request's logit_bias entries plus, while min_tokens
# is unmet, its EOS and stop_token_ids (blocked with -inf) must fit.
MAX_BIAS_TOKENS = 64
_INT64 = (-(2**63), 2**63 - 1)
# Integer fields bounded only by msgpack's 64 bits here; the InputProcessor bounds them further
# against the model (vocabulary, max_model_len) before anything reaches a device array.
_INT64_FIELDS = (
    "seed",
    "top_k",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the output (vLLM's `structured_outputs`): exactly one of json (a JSON
    schema, as a dict or its text), regex, choice, grammar (Lark or EBNF/GBNF), json_object
    (any JSON object) or structural_tag (vLLM's JSON: structures of begin/schema/end, and
    triggers). Options: disable_any_whitespace (compact JSON), disable_additional_properties
    (objects take only the schema's properties), whitespace_pattern (a regex for JSON
    whitespace)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(self.KINDS)}; got {', '.join(kinds) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be non-empty strings, got {self.choice!r}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request. Temperature below 1e-5 means greedy; top_k 0 or -1 = off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # with skip_special_tokens false (vLLM's)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Words never generated (vLLM's): each tokenized with and without a leading space; the
    # InputProcessor fills bad_words_token_ids from them (the engine reads only those).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        for name in _INT64_FIELDS:  # JSON ints are unbounded; msgpack's are not
            value = getattr(self, name)
            if isinstance(value, int):
                _check(_INT64[0] <= value <= _INT64[1], name, value, "a 64-bit signed integer")
        _check(1 <= self.n <= MAX_N, "n", self.n, f"in [1, {MAX_N}]")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "non-negative")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "-1, 0 (off) or at least 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "greater than 0",
        )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "at least 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "non-negative")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"at most max_tokens={self.max_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, value, "non-negative")
        if self.stop is not None:
            _check(
                all(isinstance(s, str) and s for s in self.stop),
                "stop",
                self.stop,
                "non-empty strings",
            )
        if self.truncate_prompt_tokens is not None:
            _check(
                self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1,
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens,
                "an integer >= 1 or -1",
            )
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                self.allowed_token_ids,
                "a non-empty list of token ids",
            )
        if self.bad_words is not None:
            _check(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                self.bad_words,
                "non-blank strings",
            )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(
                math.isfinite(bias) and -100.0 <= bias <= 100.0,
                "logit_bias",
                bias,
                f"in [-100, 100] (token {token_id})",
            )

    def child_seed(self, index: int) -> int | None:
        """The seed of the index-th of n completions: seed + index, wrapped to 64 bits."""
        if self.seed is None:
            return None
        return (self.seed + index - _INT64[0]) % 2**64 + _INT64[0]

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Beam search (vLLM's; LLM.beam_search, entrypoints/beam_search.py): beam_width beams
    per prompt, up to max_tokens each; length_penalty: the ranking's exponent of the length
    (prompt included, vLLM's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(self.beam_width >= 1, "beam_width", self.beam_width, "at least 1")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "at least 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "non-negative")
        _check(
            math.isfinite(self.length_penalty),
            "length_penalty",
            self.length_penalty,
            "a finite number",
        )


def _check(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {expected}, got {value!r}")
