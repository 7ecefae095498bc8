"""The on-device sampler: exact masks and penalties on hand-made vocabularies, sampled
frequencies against softmax, seeded reproducibility, logprobs, and one compile for all mixes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.sampler import (
    SamplingMetadata,
    apply_penalties_and_bias,
    apply_sampling_filters,
    compute_prompt_logprobs,
    sample,
)

V = 8  # vocabulary of every hand-made case
B = 2  # bias slots per row
NUM_DRAWS = 20_000  # rows of a frequency test; every unseeded row draws with its own key
# Chi-square critical values at p = 1e-3, by degrees of freedom. Keys are fixed, so the tests
# are deterministic; these bounds only say how far from the target a correct sampler may land.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}

# p = [0.4, 0.3, 0.15, 0.1, 0.05, 0, 0, 0]: no two partial sums tie with the top_p values used.
PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0])
LOGITS = np.log(np.where(PROBS > 0, PROBS, 1e-30)).astype(np.float32)

sample_jit = jax.jit(sample, static_argnames="num_logprobs")
filters_jit = jax.jit(apply_sampling_filters)


def make_md(num_rows: int, **overrides) -> SamplingMetadata:
    """Neutral metadata (temperature 1, every filter and penalty off), with per-row overrides;
    a scalar override is broadcast to every row."""
    fields = dict(
        temperature=np.ones(num_rows, np.float32),
        top_k=np.zeros(num_rows, np.int32),
        top_p=np.ones(num_rows, np.float32),
        min_p=np.zeros(num_rows, np.float32),
        presence_penalty=np.zeros(num_rows, np.float32),
        frequency_penalty=np.zeros(num_rows, np.float32),
        repetition_penalty=np.ones(num_rows, np.float32),
        prompt_mask=np.zeros((num_rows, V), bool),
        output_counts=np.zeros((num_rows, V), np.int32),
        bias_token_ids=np.full((num_rows, B), -1, np.int32),
        bias_values=np.zeros((num_rows, B), np.float32),
        seeds=np.zeros(num_rows, np.uint32),
        seeds_hi=np.zeros(num_rows, np.uint32),
        has_seed=np.zeros(num_rows, bool),
        output_positions=np.zeros(num_rows, np.int32),
    )
    for name, value in overrides.items():
        base = fields[name]
        fields[name] = np.broadcast_to(np.asarray(value, base.dtype), base.shape).copy()
    return SamplingMetadata(**{k: jnp.asarray(v) for k, v in fields.items()})


def draw_counts(logits_row: np.ndarray, seed: int = 0, **params) -> np.ndarray:
    """Token counts over NUM_DRAWS rows that all hold logits_row and the same parameters."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row), (NUM_DRAWS, V))
    out = sample_jit(logits, make_md(NUM_DRAWS, **params), jax.random.PRNGKey(seed), num_logprobs=0)
    return np.bincount(np.asarray(out.token_ids), minlength=V)


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic over the tokens with probs > 0, and its degrees of freedom."""
    support = probs > 0
    expected = counts.sum() * probs[support]
    return float(np.sum((counts[support] - expected) ** 2 / expected)), int(support.sum()) - 1


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    """Only tokens with probs > 0 are drawn, at frequencies consistent with probs."""
    probs = probs / probs.sum()
    assert set(np.flatnonzero(counts)) == set(np.flatnonzero(probs)), counts
    stat, dof = chi2(counts, probs)
    assert stat < CHI2_CRIT[dof], (stat, counts, np.round(probs * counts.sum()))


def kept(filtered: jax.Array) -> list[set[int]]:
    return [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in np.asarray(filtered)]


# ---------------------------------------------------------------- penalties and bias


def test_penalties_and_bias_change_logits_exactly():
    logits = np.zeros((4, V), np.float32)
    logits[0] = [2.0, -1.0, 0.5, 3.0, 1.0, -2.0, 0.0, 0.25]
    logits[2] = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    logits[3] = [0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    prompt_mask = np.zeros((4, V), bool)
    prompt_mask[0, [0, 5]] = True
    prompt_mask[2, 2] = True
    prompt_mask[3, 4] = True
    counts = np.zeros((4, V), np.int32)
    counts[0, [1, 2, 6]] = [2, 1, 3]
    md = make_md(
        4,
        repetition_penalty=[2.0, 1.0, 2.0, 1.5],
        frequency_penalty=[0.5, 0.0, 0.0, 0.0],
        presence_penalty=[0.25, 0.0, 0.0, 0.0],
        prompt_mask=prompt_mask,
        output_counts=counts,
        # Row 0: +1.5 on token 3, an unused slot (-1) whose value must be ignored.
        # Row 2: two slots on the same token add up, before the repetition penalty.
        # Row 3: -inf (min_tokens) survives the repetition penalty.
        bias_token_ids=[[3, -1], [-1, -1], [2, 2], [4, -1]],
        bias_values=[[1.5, 100.0], [7.0, 7.0], [1.0, 2.0], [-np.inf, 0.0]],
    )
    got = np.asarray(apply_penalties_and_bias(jnp.asarray(logits), md))

    # Row 0 by hand: seen = {0, 5} (prompt) + {1, 2, 6} (output). Positive seen logits are
    # divided by 2, non-positive ones multiplied by 2; then -0.5 * count and -0.25 if output.
    expected0 = [2.0 / 2, -1.0 * 2 - 1.0 - 0.25, 0.5 / 2 - 0.5 - 0.25, 3.0 + 1.5, 1.0, -4.0,
                 0.0 - 1.5 - 0.25, 0.25]  # fmt: skip
    np.testing.assert_array_equal(got[0], np.float32(expected0))
    np.testing.assert_array_equal(got[1], logits[1])
    np.testing.assert_array_equal(got[2], [0, 0, (1.0 + 3.0) / 2, 0, 0, 0, 0, 0])
    assert got[3, 4] == -np.inf
    np.testing.assert_array_equal(np.delete(got[3], 4), 0.0)


def test_greedy_rows_take_argmax_of_processed_logits():
    logits = jnp.asarray(np.tile(LOGITS, (4, 1)))
    counts = np.zeros((4, V), np.int32)
    counts[1, 0] = 1
    md = make_md(
        4,
        temperature=[0.0, 0.0, 0.0, 1e-6],
        bias_token_ids=[[-1, -1], [-1, -1], [3, -1], [0, 1]],
        bias_values=[[0, 0], [0, 0], [5.0, 0], [-np.inf, -np.inf]],
        presence_penalty=[0.0, 2.0, 0.0, 0.0],
        output_counts=counts,
    )
    out = sample_jit(logits, md, jax.random.PRNGKey(0), num_logprobs=0)
    # Row 1: logit(0) = log 0.4 - 2 < log 0.3; row 2: token 3 biased up; row 3: 0, 1 blocked.
    np.testing.assert_array_equal(out.token_ids, [0, 1, 3, 2])


def test_greedy_rows_stay_greedy_next_to_random_rows():
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (NUM_DRAWS, V))
    greedy = np.arange(NUM_DRAWS) % 2 == 0
    md = make_md(NUM_DRAWS, temperature=np.where(greedy, 0.0, 1.0))
    tokens = np.asarray(sample_jit(logits, md, jax.random.PRNGKey(0), num_logprobs=0).token_ids)
    assert np.all(tokens[greedy] == 0)
    assert_follows(np.bincount(tokens[~greedy], minlength=V), PROBS)


def test_min_tokens_bias_blocks_the_stop_token():
    eos = 5
    logits = LOGITS.copy()
    logits[eos] = 5.0  # by far the most likely token
    blocked = draw_counts(logits, bias_token_ids=[eos, -1], bias_values=[-np.inf, 0.0])
    assert blocked[eos] == 0
    assert_follows(blocked, PROBS)  # renormalised over the other tokens
    greedy = draw_counts(
        logits, temperature=0.0, bias_token_ids=[eos, -1], bias_values=[-np.inf, 0.0]
    )
    assert greedy[0] == NUM_DRAWS


# ---------------------------------------------------------------- filters


@pytest.mark.parametrize(
    "top_k, top_p, min_p, expected",
    [
        (0, 1.0, 0.0, {0, 1, 2, 3, 4, 5, 6, 7}),  # everything off
        (1, 1.0, 0.0, {0}),
        (3, 1.0, 0.0, {0, 1, 2}),
        (8, 1.0, 0.0, {0, 1, 2, 3, 4, 5, 6, 7}),
        (50, 1.0, 0.0, {0, 1, 2, 3, 4, 5, 6, 7}),  # k > V
        (0, 0.35, 0.0, {0}),
        (0, 0.65, 0.0, {0, 1}),  # 0.4 < 0.65 <= 0.7
        (0, 0.75, 0.0, {0, 1, 2}),  # 0.7 < 0.75 <= 0.85
        (0, 0.96, 0.0, {0, 1, 2, 3, 4}),
        (0, 1e-9, 0.0, {0}),  # always at least one token
        (0, 1.0, 0.3, {0, 1, 2}),  # p >= 0.3 * 0.4 = 0.12
        (0, 1.0, 1.0, {0}),
        # top-p over the top-3 renormalised: 0.4 / 0.85 = 0.47 < 0.8 <= 0.7 / 0.85 = 0.82
        # (without top-k, 0.8 would need token 2 as well).
        (3, 0.8, 0.0, {0, 1}),
        (0, 0.8, 0.0, {0, 1, 2}),
        # min-p before top-p (vLLM V1's order): min-p keeps {0, 1, 2}, renormalised to
        # 0.47, 0.35, 0.18, so top_p 0.45 keeps {0}; top-p first would keep {0, 1}.
        (0, 0.45, 0.3, {0}),
    ],
)
def test_filters_keep_exactly_the_right_tokens(top_k, top_p, min_p, expected):
    filtered = filters_jit(
        jnp.asarray(LOGITS)[None],
        top_k=jnp.array([top_k]),
        top_p=jnp.array([top_p], jnp.float32),
        min_p=jnp.array([min_p], jnp.float32),
    )
    assert kept(filtered) == [expected]
    ids = sorted(expected)
    np.testing.assert_array_equal(np.asarray(filtered)[0, ids], LOGITS[ids])  # values untouched


def test_filters_vary_per_row_and_keep_ties():
    logits = np.array(
        [LOGITS, LOGITS, LOGITS, [1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]], np.float32
    )
    filtered = filters_jit(
        jnp.asarray(logits),
        top_k=jnp.array([2, 0, 5, 2, 0]),
        top_p=jnp.array([1.0, 0.65, 1.0, 1.0, 0.3], jnp.float32),
        min_p=jnp.zeros(5, jnp.float32),
    )
    # Ties with the cut-off token are all kept: three tokens at the top for top_k=2, and the
    # whole flat row for top_p=0.3.
    assert kept(filtered) == [{0, 1}, {0, 1}, {0, 1, 2, 3, 4}, {0, 1, 2}, set(range(V))]


@pytest.mark.parametrize(
    "params, allowed",
    [
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.65), [0, 1]),
        (dict(min_p=0.3), [0, 1, 2]),
        (dict(top_k=4, top_p=0.8), [0, 1, 2]),  # 0.85 / 0.95 = 0.89 >= 0.8 > 0.7 / 0.95
    ],
)
def test_sampling_draws_only_kept_tokens_renormalised(params, allowed):
    counts = draw_counts(LOGITS, **params)
    probs = np.zeros(V)
    probs[allowed] = PROBS[allowed]
    assert_follows(counts, probs)


def test_frequencies_match_softmax_with_temperature():
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 0.2, 0.8, -2.0], np.float32)
    for temperature in (1.0, 0.5, 2.0):
        counts = draw_counts(logits, seed=int(temperature * 10), temperature=temperature)
        assert_follows(counts, np.asarray(jax.nn.softmax(logits / temperature)))
    # The check can fail: draws at T=0.5 are far from softmax(logits).
    counts = draw_counts(logits, temperature=0.5)
    assert chi2(counts, np.asarray(jax.nn.softmax(logits)))[0] > 10 * CHI2_CRIT[7]


def test_top_k_1_equals_greedy():
    logits = jax.random.normal(jax.random.PRNGKey(3), (NUM_DRAWS, V))
    out = sample_jit(
        logits, make_md(NUM_DRAWS, top_k=1, temperature=1.3), jax.random.PRNGKey(1), num_logprobs=0
    )
    np.testing.assert_array_equal(out.token_ids, jnp.argmax(logits, axis=-1))


# ---------------------------------------------------------------- randomness


def test_seeded_rows_reproduce_across_rows_neighbours_and_step_keys():
    positions = np.arange(16)
    flat = jnp.zeros((16, V))  # uniform: every draw is a fresh 1-in-8 choice
    batch_a = make_md(16, seeds=1234, has_seed=True, output_positions=positions)
    draws_a = np.asarray(sample_jit(flat, batch_a, jax.random.PRNGKey(0), num_logprobs=0).token_ids)

    # Same request and positions, shuffled to other rows, among unseeded neighbours, with a
    # different seed in some rows, other filters on in the batch, and another step key.
    order = np.random.default_rng(0).permutation(16)
    has_seed = np.ones(16, bool)
    has_seed[order[12:]] = False
    seeds = np.where(np.isin(np.arange(16), order[8:12]), 99, 1234)
    batch_b = make_md(
        16,
        seeds=seeds,
        has_seed=has_seed,
        output_positions=positions[order],
        top_k=np.where(seeds == 99, 2, 0),
    )
    out_b = sample_jit(flat[order], batch_b, jax.random.PRNGKey(7), num_logprobs=0)
    draws_b = np.asarray(out_b.token_ids)

    same_request = (seeds == 1234) & has_seed
    np.testing.assert_array_equal(draws_b[same_request], draws_a[order][same_request])
    assert len(set(draws_a.tolist())) > 1  # different positions give different draws
    other_seed = np.asarray(
        sample_jit(
            flat,
            make_md(16, seeds=4321, has_seed=True, output_positions=positions),
            jax.random.PRNGKey(0),
            num_logprobs=0,
        ).token_ids
    )
    assert not np.array_equal(other_seed, draws_a)


def test_unseeded_rows_follow_the_step_key():
    flat = jnp.zeros((16, V))
    md = make_md(16)
    a = sample_jit(flat, md, jax.random.PRNGKey(0), num_logprobs=0).token_ids
    b = sample_jit(flat, md, jax.random.PRNGKey(1), num_logprobs=0).token_ids
    again = sample_jit(flat, md, jax.random.PRNGKey(0), num_logprobs=0).token_ids
    np.testing.assert_array_equal(a, again)
    assert not np.array_equal(a, b)
    assert len(set(np.asarray(a).tolist())) > 1  # rows draw independently


def test_typed_key_matches_raw_key():
    flat = jnp.zeros((16, V))
    md = make_md(16)
    raw = sample_jit(flat, md, jax.random.PRNGKey(5), num_logprobs=0).token_ids
    typed = sample_jit(flat, md, jax.random.key(5), num_logprobs=0).token_ids
    np.testing.assert_array_equal(raw, typed)


def test_garbage_padding_row_does_not_touch_other_rows():
    logits = np.tile(LOGITS, (4, 1))
    md_clean = make_md(4, temperature=[1.0, 0.7, 0.0, 0.0], top_p=[1.0, 0.9, 1.0, 1.0])
    clean = sample_jit(jnp.asarray(logits), md_clean, jax.random.PRNGKey(2), num_logprobs=3)

    logits[3] = np.nan
    garbage = md_clean._replace(
        temperature=md_clean.temperature.at[3].set(jnp.nan),
        top_k=md_clean.top_k.at[3].set(-5),
        top_p=md_clean.top_p.at[3].set(0.0),
        min_p=md_clean.min_p.at[3].set(2.0),
        repetition_penalty=md_clean.repetition_penalty.at[3].set(0.0),
        bias_token_ids=md_clean.bias_token_ids.at[3].set(V + 3),
        bias_values=md_clean.bias_values.at[3].set(jnp.nan),
    )
    dirty = sample_jit(jnp.asarray(logits), garbage, jax.random.PRNGKey(2), num_logprobs=3)
    for clean_field, dirty_field in zip(clean, dirty, strict=True):
        np.testing.assert_array_equal(clean_field[:3], dirty_field[:3])
    assert np.all(np.isfinite(np.asarray(dirty.logprobs[:3])))


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits():
    logits = jax.random.normal(jax.random.PRNGKey(4), (4, V)) * 2
    order = np.argsort(-np.asarray(logits), axis=-1)
    # Row 0 is pushed to its 5th-ranked token by a bias; penalties and temperature elsewhere
    # must not change the reported logprobs.
    md = make_md(
        4,
        temperature=[0.0, 0.3, 2.0, 1.0],
        repetition_penalty=[1.0, 1.5, 1.0, 1.0],
        presence_penalty=[0.0, 0.0, 1.0, 0.0],
        prompt_mask=np.ones((4, V), bool),
        output_counts=np.ones((4, V), np.int32),
        bias_token_ids=[[order[0, 4], -1], [-1, -1], [-1, -1], [-1, -1]],
        bias_values=[[100.0, 0.0], [0, 0], [0, 0], [0, 0]],
    )
    out = sample_jit(logits, md, jax.random.PRNGKey(0), num_logprobs=3)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    rows = np.arange(4)
    tokens = np.asarray(out.token_ids)

    assert tokens[0] == order[0, 4] and out.sampled_rank[0] == 5
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0], tokens)
    np.testing.assert_allclose(out.logprobs[:, 0], ref[rows, tokens], rtol=1e-6)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 1:], order[:, :3])
    np.testing.assert_allclose(
        out.logprobs[:, 1:], np.take_along_axis(ref, order[:, :3], 1), rtol=1e-6
    )
    assert np.all(np.diff(np.asarray(out.logprobs[:, 1:]), axis=-1) <= 0)
    np.testing.assert_array_equal(
        out.sampled_rank, 1 + np.sum(ref > ref[rows, tokens][:, None], axis=-1)
    )

    no_top = sample_jit(logits, md, jax.random.PRNGKey(0), num_logprobs=0)
    assert no_top.logprobs.shape == (4, 1) and no_top.logprob_token_ids.shape == (4, 1)
    np.testing.assert_array_equal(no_top.token_ids, tokens)
    np.testing.assert_array_equal(no_top.logprobs[:, 0], out.logprobs[:, 0])

    # Logprobs switched off at run time (the runner's want_logprobs): same tokens, zeros.
    for want in (np.bool_(False), np.bool_(True)):
        got = sample_jit(logits, md, jax.random.PRNGKey(0), num_logprobs=3, want_logprobs=want)
        np.testing.assert_array_equal(got.token_ids, tokens)
        expected = out if want else jax.tree.map(np.zeros_like, out)
        for name in ("logprobs", "logprob_token_ids", "sampled_rank"):
            np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))


@pytest.mark.parametrize("num_logprobs", [0, 2])
def test_compute_prompt_logprobs(num_logprobs):
    logits = jax.random.normal(jax.random.PRNGKey(6), (5, V)).astype(jnp.bfloat16)
    targets = jnp.array([3, 0, 7, 7, 1])
    fn = jax.jit(compute_prompt_logprobs, static_argnames="num_logprobs")
    values, ids, ranks = fn(logits, targets, num_logprobs=num_logprobs)

    ref = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    rows = np.arange(5)
    assert values.shape == ids.shape == (5, num_logprobs + 1)
    np.testing.assert_array_equal(ids[:, 0], targets)
    np.testing.assert_allclose(values[:, 0], ref[rows, targets], rtol=1e-6)
    top = np.argsort(-ref, axis=-1, kind="stable")[:, :num_logprobs]
    np.testing.assert_array_equal(ids[:, 1:], top)
    np.testing.assert_allclose(values[:, 1:], np.take_along_axis(ref, top, 1), rtol=1e-6)
    np.testing.assert_array_equal(ranks, 1 + np.sum(ref > ref[rows, targets][:, None], -1))


# ---------------------------------------------------------------- compilation and checks


def test_one_compile_serves_every_parameter_mix():
    fn = jax.jit(functools.partial(sample, num_logprobs=2))
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, V))
    mixes = [
        make_md(4, temperature=0.0),  # all greedy
        make_md(4),  # all plain random
        make_md(4, temperature=[0.0, 0.7, 1.0, 1.5], top_k=[0, 3, 0, 1], top_p=[1, 1, 0.8, 1]),
        make_md(
            4,
            min_p=0.2,
            seeds=[1, 2, 3, 4],
            has_seed=[True, False, True, False],
            output_positions=[0, 5, 9, 1],
        ),
        make_md(
            4,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            output_counts=np.ones((4, V)),
            bias_token_ids=[[1, 2]] * 4,
            bias_values=[[-np.inf, 3.0]] * 4,
        ),
    ]
    for i, md in enumerate(mixes):
        fn(logits, md, jax.random.PRNGKey(i)).token_ids.block_until_ready()
    assert fn._cache_size() == 1


def test_mismatched_shapes_name_the_field():
    md = make_md(4)._replace(prompt_mask=jnp.zeros((4, V + 1), bool))
    with pytest.raises(ValueError, match="prompt_mask"):
        sample(jnp.zeros((4, V)), md, jax.random.PRNGKey(0), num_logprobs=0)
    with pytest.raises(ValueError, match="temperature"):
        sample(jnp.zeros((3, V)), make_md(4), jax.random.PRNGKey(0), num_logprobs=0)
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_prompt_logprobs(jnp.zeros((3, V)), jnp.zeros(3, jnp.int32), num_logprobs=V + 1)


def test_argmax_rows_is_jnp_argmax_ties_nan_and_inf_included():
    from jaxserve.layers.sampler import argmax_rows

    x = jax.random.normal(jax.random.key(1), (6, 300))
    x = x.at[1, 7].set(jnp.nan).at[1, 9].set(jnp.nan)  # the first NaN, as argmax
    x = x.at[2].set(-jnp.inf)  # all masked: index 0
    x = x.at[3, 10].set(9.0).at[3, 20].set(9.0)  # a tie: the first
    x = x.at[4, 299].set(jnp.inf)
    got = jax.jit(argmax_rows)(x)
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
    assert got.dtype == jnp.int32 and list(got[1:5]) == [7, 0, 10, 299]


# ---------------------------------------------------------------- compiled variants


def _variants():
    from jaxserve.layers.sampler import SamplerVariant as SV

    return {  # a 4-row batch (metadata overrides) and the compiled variant that covers it
        "greedy": (dict(temperature=0.0), SV()),
        "random": (dict(temperature=[0.3, 0.7, 1.0, 1.5], seeds=[0, 5, 0, 9],
                        has_seed=[False, True, False, True]), SV(random=True)),
        "mixed": (dict(temperature=[0.0, 0.7, 1.0, 0.0]), SV(random=True, greedy=True)),
        "top_p": (dict(temperature=[1.0, 0.0, 0.8, 1.0], top_p=[0.9, 1.0, 0.5, 1.0]),
                  SV(random=True, greedy=True, top_p=True)),
        "top_k_top_p": (dict(temperature=1.0, top_k=[0, 3, 2, 0], top_p=[0.9, 1.0, 1.0, 0.7]),
                        SV(random=True, greedy=True, top_k=True, top_p=True)),
        "logprobs": (dict(temperature=0.0), SV(logprobs=True)),
        "random_logprobs": (dict(temperature=[1.0, 0.0, 0.5, 1.0]),
                            SV(random=True, greedy=True, logprobs=True)),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_variants()))
def test_each_compiled_variant_samples_what_the_full_sampler_samples(name):
    from jaxserve.layers.sampler import COMPILED_VARIANTS, FULL_VARIANT

    overrides, variant = _variants()[name]
    assert variant in COMPILED_VARIANTS
    md = make_md(4, **overrides)
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, V)) * 3
    jitted = jax.jit(sample, static_argnames=("num_logprobs", "variant"))  # as the runner runs it
    for step in range(20):
        key = jax.random.PRNGKey(step)
        fast = jitted(logits, md, key, num_logprobs=2, variant=variant)
        full = jitted(logits, md, key, num_logprobs=2, variant=FULL_VARIANT)
        np.testing.assert_array_equal(fast.token_ids, full.token_ids)
        if variant.logprobs:
            np.testing.assert_allclose(fast.logprobs, full.logprobs, rtol=1e-6)
            np.testing.assert_array_equal(fast.logprob_token_ids, full.logprob_token_ids)
        else:
            assert fast.logprobs is None


def test_variant_choice_follows_the_batch():
    from jaxserve.layers.sampler import FULL_VARIANT, SamplerVariant, pick_variant
    from jaxserve.sampling_params import SamplingParams

    def chosen(*params):
        return pick_variant(SamplerVariant.of(list(params)))

    assert chosen(SamplingParams(temperature=0)) == SamplerVariant()
    assert chosen(SamplingParams(temperature=0.5)) == SamplerVariant(random=True)
    assert chosen(SamplingParams(temperature=0), SamplingParams(temperature=1.0)) == (
        SamplerVariant(random=True, greedy=True)
    )
    assert chosen(SamplingParams(top_p=0.9)) == (
        SamplerVariant(random=True, greedy=True, top_p=True)
    )
    assert chosen(SamplingParams(top_k=5)) == (
        SamplerVariant(random=True, greedy=True, top_k=True, top_p=True)
    )
    assert chosen(SamplingParams(temperature=0, logprobs=1)) == SamplerVariant(logprobs=True)
    # a filter on a greedy row is ignored; penalties or bias need the catch-all
    assert chosen(SamplingParams(temperature=0, top_k=5)) == SamplerVariant()
    assert chosen(SamplingParams(temperature=0, presence_penalty=0.5)) == FULL_VARIANT
    assert chosen(SamplingParams(logit_bias={3: 1.0})) == FULL_VARIANT


def test_seeds_use_all_64_bits():
    """Seeds equal in their low 32 bits (5 and 5 + 2**32, -1 and 2**32 - 1) draw differently;
    a seed below 2**32 draws as PRNGKey(seed) always did."""
    from jaxserve.layers.sampler import row_uniforms

    md = make_md(3, seeds=[5, 5, 5], seeds_hi=[0, 1, 0xFFFFFFFF], has_seed=True)
    u = np.asarray(row_uniforms(md, jax.random.PRNGKey(0)))
    assert not np.allclose(u[0], u[1]) and not np.allclose(u[0], u[2])
    want = jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(5), 0), (2,), jnp.float32)
    np.testing.assert_array_equal(u[0], np.asarray(want))
