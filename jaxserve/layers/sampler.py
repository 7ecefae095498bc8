"""On-device sampler: compiled variants that each run only the passes their batch uses.

The model runner calls `sample` in its sampling step. Every request's parameters are rows of
arrays (`SamplingMetadata`, padded to S rows); which passes run is the static `SamplerVariant`
the host picks for the step from the rows' parameters (`SamplerVariant.of`, then the cheapest
compiled variant that covers it: `COMPILED_VARIANTS`). An all-greedy batch is one argmax over
[S, V]; plain sampling is an exp pass, per-block sums and two uniforms per row; filters,
penalties, bias, logprobs and a greedy row beside sampled ones add their passes only to the
variants that carry them. The last variant carries everything and skips, at run time, the
passes no row in the batch uses.

Order of operations (vLLM V1's `Sampler`, step for step):

1. logprobs of the *raw* logits (log_softmax, vLLM's default "raw_logprobs" mode);
2. logit bias: a sparse scatter-add (`logit_bias`, and -inf on stop tokens for `min_tokens`);
3. penalties: repetition (prompt + output tokens), then frequency and presence (output only);
4. greedy rows (temperature < 1e-5) take the argmax here;
5. temperature, then min-p, then top-k, then top-p (vLLM V1 applies min-p, an argmax-invariant
   logits processor, before its top-k/top-p sampler);
6. one draw per row from the renormalised probabilities (inverse CDF, below).

Top-k and top-p are exact without sorting the vocabulary: each row's cut-off is a threshold on
the logits, found by building the 32-bit order-preserving integer key of the threshold one bit
at a time (most significant first). Each of the 32 steps is one fused compare-and-reduce pass
over [S, V]: "count(key >= t) >= k" for top-k and "mass(key >= t) >= top_p * mass" for top-p.
Tokens tied with the cut-off token are all kept (as vLLM's top-k does; vLLM's sort-based top-p
breaks such ties by sort order).

The draw: the row's unnormalised probabilities w = exp(logit - max) are summed per block of
`_DRAW_BLOCK` tokens; a first uniform picks a block in proportion to its sum (a cumulative sum
over V / 256 block sums), a second picks a token inside it in proportion to w. Two random
numbers a row instead of V Gumbel draws (threefry noise over [S, V] was a quarter of a CPU
step). Randomness: a seeded row's uniforms come from fold_in(PRNGKey(seed), output_position)
only, so they reproduce whatever the batch, the row index or the step key; an unseeded row's
from fold_in(step_key, row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_GREEDY_EPS = 1e-5  # same cut-off as SamplingParams.greedy
_DRAW_BLOCK = 256  # tokens per block of the two-level inverse-CDF draw


class SamplerVariant(NamedTuple):
    """Which passes a compiled sampler runs (static). `dynamic`: the flags are upper bounds
    and each filter is skipped at run time when no row uses it (a `lax.cond`, which costs a
    device-to-host sync on GPU: only the catch-all variant has it)."""

    random: bool = False  # some row samples (temperature >= 1e-5); else argmax only
    greedy: bool = False  # with random: some row is greedy (its argmax is taken too)
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalties: bool = False  # repetition / frequency / presence
    bias: bool = False  # logit_bias, or min_tokens blocking EOS and stop tokens
    logprobs: bool = False  # sampled-token logprobs (+ top-K)
    structured: bool = False  # some row is constrained by a grammar (a token bitmask)
    dynamic: bool = False

    @classmethod
    def of(cls, params: list) -> SamplerVariant:
        """The passes a batch of SamplingParams-like rows needs (every flag exact)."""
        column = lambda name: np.array([getattr(p, name) for p in params])  # noqa: E731
        return cls.of_rows(
            column("temperature"),
            column("top_k"),
            column("top_p"),
            column("min_p"),
            penalties=np.array([is_penalised(p) for p in params], bool),
            bias=np.array([bool(p.logit_bias) for p in params], bool),
            logprobs=np.array([p.logprobs is not None for p in params], bool),
        )

    @classmethod
    def of_rows(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        min_p: np.ndarray,
        *,
        penalties: np.ndarray,
        bias: np.ndarray,
        logprobs: np.ndarray,
    ) -> SamplerVariant:
        """The passes N rows need, from their parameters as arrays ([N] each; the bool ones:
        the row is penalised / has a logit bias now / asked for logprobs)."""
        random = temperature >= _GREEDY_EPS
        return cls(
            random=bool(random.any()),
            greedy=bool(random.any() and not random.all()),
            top_k=bool((random & (top_k > 0)).any()),
            top_p=bool((random & (top_p < 1.0)).any()),
            min_p=bool((random & (min_p > 0.0)).any()),
            penalties=bool(penalties.any()),
            bias=bool(bias.any()),  # the runner adds min_tokens' blocks
            logprobs=bool(logprobs.any()),
        )

    def covers(self, other: SamplerVariant) -> bool:
        return all(mine or not theirs for mine, theirs in zip(self[:-1], other[:-1], strict=True))


def is_penalised(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty) or (
        params.repetition_penalty != 1.0
    )


# Compiled for every sequence bucket, cheapest first; a batch runs the first that covers it.
FULL_VARIANT = SamplerVariant(*[True] * len(SamplerVariant._fields))
COMPILED_VARIANTS = (
    SamplerVariant(),  # greedy
    SamplerVariant(random=True),
    SamplerVariant(random=True, greedy=True),
    SamplerVariant(random=True, greedy=True, top_p=True),
    SamplerVariant(random=True, greedy=True, top_k=True, top_p=True),
    SamplerVariant(logprobs=True),
    SamplerVariant(random=True, greedy=True, logprobs=True),
    SamplerVariant(structured=True),
    SamplerVariant(random=True, greedy=True, structured=True),
    SamplerVariant(random=True, greedy=True, top_k=True, top_p=True, structured=True),
    FULL_VARIANT,
)


def pick_variant(
    needed: SamplerVariant, ready: Callable[[SamplerVariant], bool] = lambda v: True
) -> SamplerVariant:
    """The cheapest compiled variant that runs every pass `needed` asks for, among those
    `ready` (the runner's start-up may still be compiling some; FULL_VARIANT is ready first)."""
    return next(v for v in COMPILED_VARIANTS if v.covers(needed) and ready(v))


class SamplingMetadata(NamedTuple):
    """Per-row sampling parameters, padded to S rows (pad with a greedy row: temperature 0).
    prompt_mask / output_counts may be None for a variant without penalties."""

    temperature: jax.Array  # f32[S]; < 1e-5 -> greedy
    top_k: jax.Array  # i32[S]; <= 0 = off
    top_p: jax.Array  # f32[S]; >= 1.0 = off
    min_p: jax.Array  # f32[S]; 0.0 = off
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    repetition_penalty: jax.Array  # f32[S]; 1.0 = off
    prompt_mask: jax.Array | None  # bool[S, V]; token appears in the prompt
    output_counts: jax.Array | None  # i32[S, V]; occurrences in the generated output so far
    bias_token_ids: jax.Array  # i32[S, B]; -1 = unused slot
    bias_values: jax.Array  # f32[S, B]; added to the logit of bias_token_ids
    seeds: jax.Array  # u32[S]; a 64-bit seed's low word
    seeds_hi: jax.Array  # u32[S]; its high word
    has_seed: jax.Array  # bool[S]
    output_positions: jax.Array  # i32[S]; tokens generated so far by this request
    # i32[S, ceil(V/32)]: bit t % 32 of word t // 32 clear = token t is not allowed (a
    # structured-output grammar); all bits set on free rows. None for variants without it.
    token_bitmask: jax.Array | None = None


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array | None  # f32[S, K+1]; column 0: sampled token, 1..K: top-K, descending
    logprob_token_ids: jax.Array | None  # i32[S, K+1]
    sampled_rank: jax.Array | None  # i32[S]; 1 + number of tokens with a strictly higher logprob


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    key: jax.Array,
    *,
    num_logprobs: int,
    variant: SamplerVariant = FULL_VARIANT,
    want_logprobs: jax.Array | bool = True,
) -> SamplerOutput:
    """Sample one token per row of logits: f32[S, V] (any float dtype; math in float32).

    key: the step's PRNG key (raw uint32 from `jax.random.PRNGKey` or a typed `jax.random.key`),
    used for unseeded rows only. num_logprobs (K, static) may be 0. variant (static): the
    passes to run; rows must not need one it lacks. want_logprobs (bool[], may be traced; the
    dynamic variant only): when false the logprob outputs are zeros and their [S, V] passes
    are skipped at run time. A variant without logprobs returns None for them.
    """
    _check_shapes(logits, md)
    logits = logits.astype(jnp.float32)  # [S, V]
    if variant.structured and md.token_bitmask is not None:  # first: logprobs see it (vLLM)
        logits = apply_token_bitmask(logits, md.token_bitmask)

    processed = logits
    if variant.bias:
        processed = apply_bias(processed, md)
    if variant.penalties:
        processed = apply_penalties(processed, md)
    if variant.random:
        token_ids = _sample_rows(processed, md, key, variant)
    else:
        token_ids = argmax_rows(processed)  # [S]

    if not variant.logprobs:
        return SamplerOutput(token_ids, None, None, None)

    def logprobs():
        raw = jax.nn.log_softmax(logits, axis=-1)  # [S, V]: before penalties and filters
        return _gather_logprobs(raw, token_ids, num_logprobs)

    def no_logprobs():
        s, k = logits.shape[0], num_logprobs + 1
        return jnp.zeros((s, k), jnp.float32), jnp.zeros((s, k), jnp.int32), jnp.zeros(s, jnp.int32)

    if variant.dynamic:
        lp, lp_ids, rank = lax.cond(want_logprobs, logprobs, no_logprobs)
    else:
        lp, lp_ids, rank = logprobs()
    return SamplerOutput(token_ids, lp, lp_ids, rank)


def _sample_rows(
    processed: jax.Array, md: SamplingMetadata, key: jax.Array, variant: SamplerVariant
) -> jax.Array:
    """Temperature, filters and one draw per row; greedy rows (temperature ~0) take the argmax
    of `processed` instead. f32[S, V] -> i32[S]."""
    greedy = md.temperature < _GREEDY_EPS  # [S]
    # Neutral parameters on greedy rows so they never switch a filter on for the batch.
    temperature = jnp.where(greedy, 1.0, md.temperature)
    scaled = processed / temperature[:, None]  # [S, V]
    filtered = apply_sampling_filters(
        scaled,
        top_k=jnp.where(greedy, 0, md.top_k),
        top_p=jnp.where(greedy, 1.0, md.top_p),
        min_p=jnp.where(greedy, 0.0, md.min_p),
        use=(variant.top_k, variant.top_p, variant.min_p),
        dynamic=variant.dynamic,
    )
    drawn = draw_rows(filtered, row_uniforms(md, key))
    if not variant.greedy:  # padding rows (greedy) may draw: their tokens are dropped
        return drawn

    def with_greedy_rows():
        return jnp.where(greedy, argmax_rows(processed), drawn)

    if variant.dynamic:
        return lax.cond(jnp.any(greedy), with_greedy_rows, lambda: drawn)
    return with_greedy_rows()


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf on the tokens a row's bitmask leaves out: logits f32[S, V], bitmask
    i32[S, ceil(V/32)] (bit t % 32 of word t // 32 set = token t allowed)."""
    num_rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def draw_rows(logits: jax.Array, uniforms: jax.Array) -> jax.Array:
    """One token per row of f32[S, V] logits (-inf = excluded) with probability softmax(row),
    by inverse CDF over per-block sums; uniforms: f32[S, 2] in [0, 1). -> i32[S]."""
    num_rows, vocab = logits.shape
    blocks = -(-vocab // _DRAW_BLOCK)
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # [S, 1]
    weights = jnp.exp(logits - row_max)  # [S, V]; 0 where excluded, 1 at the max
    weights = jnp.pad(weights, ((0, 0), (0, blocks * _DRAW_BLOCK - vocab)))
    weights = weights.reshape(num_rows, blocks, _DRAW_BLOCK)
    cum = jnp.cumsum(jnp.sum(weights, axis=-1), axis=-1)  # [S, blocks]
    # The first block whose cumulative sum exceeds u * total has a positive sum (the sums
    # only grow at such blocks), and u < 1 keeps it inside the row.
    block = jnp.sum(cum <= uniforms[:, :1] * cum[:, -1:], axis=-1)  # [S]
    block = jnp.minimum(block, blocks - 1)
    inner = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [S, block]
    inner_cum = jnp.cumsum(inner, axis=-1)
    offset = jnp.sum(inner_cum <= uniforms[:, 1:] * inner_cum[:, -1:], axis=-1)
    return (block * _DRAW_BLOCK + jnp.minimum(offset, _DRAW_BLOCK - 1)).astype(jnp.int32)


def row_uniforms(md: SamplingMetadata, key: jax.Array) -> jax.Array:
    """Two uniforms per row, f32[S, 2]; seeded rows depend only on (seed, output_position)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    num_rows = md.seeds.shape[0]
    step_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(num_rows))  # [S, 2]
    # (hi, lo) is the threefry key PRNGKey makes of a 64-bit seed
    seed_keys = jax.vmap(jax.random.fold_in)(
        jnp.stack([md.seeds_hi, md.seeds], axis=-1), md.output_positions
    )  # [S, 2]
    row_keys = jnp.where(md.has_seed[:, None], seed_keys, step_keys)
    return jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(row_keys)


def argmax_rows(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) for f32[S, V] -> i32[S] (the first maximum; the first NaN, if
    any), as a max and a min reduction. XLA:CPU runs argmax's (value, index) reduction one
    element at a time with its producer fused in: 4x slower on [32, 49152], 10x with the
    Gumbel noise fused, than these two vectorised passes (benchmarks/results/cpu.md)."""
    vocab = x.shape[-1]
    row_max = jnp.max(x, axis=-1, keepdims=True)  # [S, 1]; NaN if the row holds one
    hit = (x == row_max) | jnp.isnan(x)  # [S, V]
    return jnp.min(jnp.where(hit, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def compute_prompt_logprobs(
    logits: jax.Array, target_ids: jax.Array, *, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of target_ids: i32[N] under logits: f32[N, V], in `SamplerOutput`'s layout.

    Returns (logprobs f32[N, K+1], token_ids i32[N, K+1], target_rank i32[N]); column 0 is the
    target token, columns 1..K the top-K (descending).
    """
    raw_logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [N, V]
    return _gather_logprobs(raw_logprobs, target_ids.astype(jnp.int32), num_logprobs)


def apply_penalties_and_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Logit bias, then repetition, frequency and presence penalties; f32[S, V] -> f32[S, V]."""
    return apply_penalties(apply_bias(logits, md), md)


def apply_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Add bias_values at bias_token_ids (a sparse scatter); f32[S, V] -> f32[S, V]."""
    num_rows, vocab = logits.shape
    ids = md.bias_token_ids  # [S, B]
    valid = (ids >= 0) & (ids < vocab)
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)  # [S, B]
    return logits.at[rows, jnp.where(valid, ids, 0)].add(
        jnp.where(valid, md.bias_values, 0.0), mode="drop"
    )


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens)."""
    output_mask = md.output_counts > 0  # [S, V]
    # HF/vLLM rule: shrink positive logits, grow negative ones, for every token seen so far.
    rep = jnp.where(md.prompt_mask | output_mask, md.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty[:, None] * md.output_counts.astype(jnp.float32)
    return logits - md.presence_penalty[:, None] * output_mask.astype(jnp.float32)


def apply_sampling_filters(
    logits: jax.Array,
    *,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    use: tuple[bool, bool, bool] = (True, True, True),
    dynamic: bool = True,
) -> jax.Array:
    """Min-p, then top-k, then top-p on temperature-scaled logits: f32[S, V] -> f32[S, V].

    Tokens outside a row's kept set become -inf. top_k: i32[S] (<= 0 = off); top_p: f32[S]
    (>= 1 = off; the highest-probability token is always kept); min_p: f32[S] (0 = off).
    Each filter sees the distribution renormalised over what the previous ones kept. use
    (static): which of (top_k, top_p, min_p) to apply at all; dynamic: skip a used one at run
    time when no row switches it on.
    """
    use_top_k, use_top_p, use_min_p = use
    vocab = logits.shape[-1]
    neg_inf = jnp.float32(-jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # [S, 1]
    if use_min_p:  # keep p >= min_p * p_max, i.e. exp(logit - max) >= min_p
        logits = jnp.where(jnp.exp(logits - row_max) >= min_p[:, None], logits, neg_inf)
    if not (use_top_k or use_top_p):
        return logits
    keys = _order_key(logits)  # u32[S, V]

    def top_k_filter(x: jax.Array) -> jax.Array:
        k = jnp.where(top_k > 0, top_k, vocab)  # [S]; k >= V keeps everything
        cut = _largest_key_where(keys, lambda t: jnp.sum(keys >= t, axis=-1) >= k)
        return jnp.where(keys >= cut[:, None], x, neg_inf)

    def top_p_filter(x: jax.Array) -> jax.Array:
        weights = jnp.exp(x - row_max)  # [S, V]; unnormalised probabilities, 0 where masked
        target = top_p * jnp.sum(weights, axis=-1)  # [S]

        def reaches_top_p(t: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(keys >= t, weights, 0.0), axis=-1) >= target

        cut = _largest_key_where(keys, reaches_top_p)
        cut = jnp.minimum(cut, jnp.max(keys, axis=-1))  # keep at least the top token
        cut = jnp.where(top_p >= 1.0, 0, cut)
        return jnp.where(keys >= cut[:, None], x, neg_inf)

    def maybe(used: bool, on, fn, x):
        if not used:
            return x
        return lax.cond(jnp.any(on), fn, lambda y: y, x) if dynamic else fn(x)

    logits = maybe(use_top_k, top_k > 0, top_k_filter, logits)
    return maybe(use_top_p, top_p < 1.0, top_p_filter, logits)


def _gather_logprobs(
    logprobs: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chosen token's logprob and rank, plus the top-K: f32[S, V], i32[S] -> [S, K+1] x2, [S]."""
    if not 0 <= num_logprobs <= logprobs.shape[-1]:
        raise ValueError(f"num_logprobs must be in [0, {logprobs.shape[-1]}], got {num_logprobs}")
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)  # [S, 1]
    rank = 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)  # [S]
    if num_logprobs == 0:
        return chosen, token_ids[:, None], rank
    top_vals, top_ids = lax.top_k(logprobs, num_logprobs)  # [S, K]
    values = jnp.concatenate([chosen, top_vals], axis=-1)
    ids = jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return values, ids, rank


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of float32 x (-0.0 folded into +0.0, so equal floats tie)."""
    bits = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_where(keys: jax.Array, holds) -> jax.Array:
    """Per row, the largest uint32 t with holds(t[:, None]) true; holds must be monotone
    (true for small t, false above some point) and is taken as true at t = 0."""

    def step(i: jax.Array, t: jax.Array) -> jax.Array:
        candidate = t | lax.shift_left(jnp.uint32(1), (31 - i).astype(jnp.uint32))  # [S]
        return jnp.where(holds(candidate[:, None]), candidate, t)

    # Keep the loop rolled: unrolled (Python loop or unroll=True), XLA fuses the chain of
    # selects into every later reduction and compiling takes minutes instead of a second.
    return lax.fori_loop(0, 32, step, jnp.zeros(keys.shape[:1], jnp.uint32))


def _check_shapes(logits: jax.Array, md: SamplingMetadata) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [S, V], got shape {logits.shape}")
    for name, value in md._asdict().items():
        if value is None:
            continue
        expected = logits.shape if name in ("prompt_mask", "output_counts") else None
        if value.shape[0] != logits.shape[0] or (expected and value.shape != expected):
            raise ValueError(
                f"SamplingMetadata.{name} has shape {value.shape}; expected "
                f"{expected or (logits.shape[0], '...')} for logits of shape {logits.shape}"
            )
    if md.bias_token_ids.shape != md.bias_values.shape:
        raise ValueError(
            f"bias_token_ids {md.bias_token_ids.shape} and bias_values "
            f"{md.bias_values.shape} must have the same [S, B] shape"
        )
