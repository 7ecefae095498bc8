"""Gated delta-net linear attention (Qwen3-Next's `linear_attention` layers) over a flat
ragged batch, with each request's state in a fixed slot (its input-batch row).

Per token: q, k, v come from a causal depthwise convolution (width K, SiLU) over the
projected inputs, whose last K - 1 inputs per request are its conv state [K-1, C]; q and k
are L2-normalised, q scaled by Dk ** -0.5, and each key head serves Hv / Hk value heads. The
recurrent state S [Hv, Dk, Dv] decays by exp(g), g = -exp(A_log) * softplus(a + dt_bias),
then takes the delta rule's correction: S += k (beta (v - S^T k))^T, beta = sigmoid(b); the
output is S^T q. The outputs are RMS-normalised per head, times the weight and SiLU(z).

The sequences of a step advance together from the states their requests' previous steps
left (a sequence whose first token is at position 0 starts from zeros: a new request, or one
recomputed after preemption):
  recurrent  a decode-only step's sequences, and a mixed step's single-token ones: one
             token each, the update above once;
  chunked    a mixed step's multi-token sequences, GROUP at a time (gathered to the front
             first, so a pass never carries the step's other sequences): CHUNK tokens of
             each per iteration of a loop as long as its longest needs. Within a chunk, with
             G the cumulative log decay and u_t = beta_t (v_t - S'_t^T k_t) the values the
             rule writes, the u solve a unit lower-triangular system (I + A) u = beta (v -
             exp(G) K S0), A[t, i] = beta_t exp(G_t - G_i) k_t . k_i for i < t (forward
             substitution); then O = exp(G) Q S0 + (exp(G_t - G_i) q_t . k_i)_{i <= t} U and
             S = exp(G_C) S0 + K^T (exp(G_C - G) U): matrix products, not a step per token.
             Tokens past a sequence's end in its last chunk have beta = 0 and g = 0, so they
             change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.linear import Linear
from jaxserve.layers.norm import rms_normalize

L2_EPS = 1e-6  # HF's l2norm (the FLA library's)


def _l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


CHUNK = 64  # tokens per sequence a chunked iteration takes, at most
GROUP = 4  # multi-token sequences a chunked pass takes at once


def gated_delta_scan(
    mixed,
    a,
    b,
    conv_w,
    a_log,
    dt_bias,
    query_start_loc,
    num_seqs,
    token_rows,
    positions,
    conv_state,
    rec_state,
    *,
    num_k_heads: int,
    k_head_dim: int,
    v_head_dim: int,
    chunk: int | None = CHUNK,
):
    """The convolution and the gated delta rule over each sequence's tokens.

    Args:
      mixed: [T, C] the projected q, k, v before the convolution (C = Hk (2 Dk + r Dv): per
        key head its q, its k and its r = Hv / Hk value heads' v, so that tensor
        parallelism splits the channels by key heads).
      a, b: [T, Hv] the decay's and beta's inputs.
      conv_w: [K, C] the depthwise kernel (oldest input first, channels as mixed's);
        a_log, dt_bias: [Hv].
      query_start_loc: i32[S+1]; num_seqs: i32[1]; token_rows, positions: i32[T].
      conv_state: [N, K-1, C]; rec_state: f32[N, Hv, Dk, Dv]: every input-batch row's.
      chunk: None: the recurrent form for every sequence (a decode-only step); else
        single-token sequences take one recurrent step and the others the chunked form,
        min(chunk, T) tokens of GROUP sequences at a time.

    Returns:
      (o f32[T, Hv, Dv] (zero for padding tokens), conv_state, rec_state) with each real
      sequence's row advanced past its tokens.
    """
    num_tokens = mixed.shape[0]
    rows_n = conv_state.shape[0]
    num_v_heads = a.shape[1]
    max_seqs = query_start_loc.shape[0] - 1
    real = jnp.arange(max_seqs) < num_seqs[0]
    start = query_start_loc[:-1]
    q_len = jnp.where(real, query_start_loc[1:] - start, 0)
    first = jnp.minimum(start, num_tokens - 1)
    row = jnp.where(q_len > 0, token_rows[first], rows_n)  # N: no row (dropped)
    fresh = positions[first] == 0
    repeat = num_v_heads // num_k_heads

    def qkv(y):
        """Convolved inputs f32[..., C] (per key head: q, k, its value heads' v) -> q, k
        [..., Hv, Dk] (normalised, grouped), v [..., Hv, Dv]."""
        y = y.reshape(*y.shape[:-1], num_k_heads, -1)
        q, k, v = y[..., :k_head_dim], y[..., k_head_dim : 2 * k_head_dim], y[..., 2 * k_head_dim :]
        v = v.reshape(*y.shape[:-2], num_v_heads, v_head_dim)
        q = jnp.repeat(_l2_normalize(q) * k_head_dim**-0.5, repeat, axis=-2)
        return q, jnp.repeat(_l2_normalize(k), repeat, axis=-2), v

    inputs = (mixed, a, b, conv_w, -jnp.exp(a_log.astype(jnp.float32)), dt_bias, qkv)

    def run(form, seq_start, seq_len, seq_row, seq_fresh, conv_state, rec_state, **kw):
        """One form over the sequences given (their rows gathered, then written back)."""
        at = jnp.minimum(seq_row, rows_n - 1)
        conv = jnp.where(seq_fresh[:, None, None], 0, conv_state[at])  # [S', K-1, C]
        rec = jnp.where(seq_fresh[:, None, None, None], 0.0, rec_state[at])
        out, conv, rec = form(*inputs, seq_start, seq_len, conv, rec, **kw)
        conv_state = conv_state.at[seq_row].set(conv.astype(conv_state.dtype), mode="drop")
        return out, conv_state, rec_state.at[seq_row].set(rec, mode="drop")

    if chunk is None:
        return run(_recurrent, start, q_len, row, fresh, conv_state, rec_state)
    single = q_len == 1
    out, conv_state, rec_state = run(
        _recurrent,
        start,
        jnp.where(single, 1, 0),
        jnp.where(single, row, rows_n),
        fresh,
        conv_state,
        rec_state,
    )
    # The multi-token sequences first (a stable sort), GROUP of them per pass.
    multi = q_len > 1
    group = min(GROUP, max_seqs)
    order = jnp.argsort(~multi, stable=True)
    order = jnp.pad(order, (0, group), constant_values=max_seqs)  # max_seqs: no sequence
    num_multi = jnp.sum(multi)
    pad = lambda x, v: jnp.pad(x, (0, 1), constant_values=v)  # noqa: E731  [S+1]

    def one_pass(g, carry):
        out, conv_state, rec_state = carry
        ids = jax.lax.dynamic_slice_in_dim(order, g * group, group)
        ok = g * group + jnp.arange(group) < num_multi
        seq_len = jnp.where(ok, pad(q_len, 0)[ids], 0)
        o, conv_state, rec_state = run(
            _chunked,
            pad(start, 0)[ids],
            seq_len,
            jnp.where(ok, pad(row, rows_n)[ids], rows_n),
            pad(fresh, False)[ids],
            conv_state,
            rec_state,
            chunk=min(chunk, num_tokens),
        )
        return out + o, conv_state, rec_state

    passes = (num_multi + group - 1) // group
    return jax.lax.fori_loop(0, passes, one_pass, (out, conv_state, rec_state))


def _recurrent(mixed, a, b, conv_w, decay_rate, dt_bias, qkv, start, q_len, conv, rec):
    """The recurrent form: every sequence (start, q_len i32[S']) one token per iteration,
    from states conv [S', K-1, C] and rec f32[S', Hv, Dk, Dv] -> (o f32[T, Hv, Dv] for
    their tokens, zero elsewhere; conv; rec)."""
    num_tokens = mixed.shape[0]

    def body(i, carry):
        conv, rec, out = carry
        active = i < q_len  # [S']
        tok = jnp.minimum(start + i, num_tokens - 1)
        window = jnp.concatenate([conv, mixed[tok][:, None]], axis=1)  # [S', K, C]
        y = jax.nn.silu(jnp.einsum("skc,kc->sc", window, conv_w).astype(mixed.dtype))
        q, k, v = qkv(y.astype(jnp.float32))  # [S', Hv, Dk], [S', Hv, Dk], [S', Hv, Dv]
        g = decay_rate * jax.nn.softplus(a[tok].astype(jnp.float32) + dt_bias)  # [S', Hv]
        beta = jax.nn.sigmoid(b[tok]).astype(jnp.float32)
        decayed = rec * jnp.exp(g)[..., None, None]
        delta = (v - jnp.einsum("shkv,shk->shv", decayed, k)) * beta[..., None]
        new = decayed + k[..., :, None] * delta[..., None, :]
        o = jnp.einsum("shkv,shk->shv", new, q)
        conv = jnp.where(active[:, None, None], window[:, 1:], conv)
        rec = jnp.where(active[:, None, None, None], new, rec)
        out = out.at[jnp.where(active, start + i, num_tokens)].set(o, mode="drop")
        return conv, rec, out

    out = jnp.zeros((num_tokens, rec.shape[1], rec.shape[3]), jnp.float32)
    conv, rec, out = jax.lax.fori_loop(0, jnp.max(q_len), body, (conv, rec, out))
    return out, conv, rec


def _unit_lower_solve(lower: jax.Array, rhs: jax.Array) -> jax.Array:
    """(I + lower) u = rhs for strictly lower-triangular lower [..., C, C] and rhs [..., C, D],
    by forward substitution (C steps). Not jax.scipy's solve_triangular: on CPU that is a
    LAPACK custom call, registered only once jax traces one, so an executable loaded from
    the cache in a fresh process would call an unset function (a segfault)."""

    def row(t, u):
        u_t = rhs[..., t, :] - jnp.einsum("...c,...cd->...d", lower[..., t, :], u)
        return u.at[..., t, :].set(u_t)

    return jax.lax.fori_loop(0, lower.shape[-1], row, jnp.zeros_like(rhs))


def _chunked(mixed, a, b, conv_w, decay_rate, dt_bias, qkv, start, q_len, conv, rec, *, chunk: int):
    """The chunked form (module docstring) over sequences starting at start i32[S] with
    q_len i32[S] tokens, from states conv [S, K-1, C] and rec f32[S, Hv, Dk, Dv] ->
    (o f32[T, Hv, Dv], conv, rec)."""
    num_tokens = mixed.shape[0]
    width = conv.shape[1]  # K - 1
    steps = jnp.arange(chunk)
    causal = steps[:, None] >= steps[None, :]  # [C, C]: i <= t

    def body(j, carry):
        conv, rec, out = carry
        pos = j * chunk + steps  # [C] within each sequence
        active = pos[None, :] < q_len[:, None]  # [S, C]
        tok = jnp.minimum(start[:, None] + pos, num_tokens - 1)  # [S, C]
        ext = jnp.concatenate([conv, mixed[tok]], axis=1)  # [S, K-1 + C, C]
        windows = jnp.stack([ext[:, i : i + chunk] for i in range(width + 1)], axis=2)
        y = jax.nn.silu(jnp.einsum("stkc,kc->stc", windows, conv_w).astype(mixed.dtype))
        q, k, v = qkv(y.astype(jnp.float32))  # [S, C, Hv, D*]
        n = jnp.clip(q_len - j * chunk, 0, chunk)  # active tokens: the state's last inputs
        conv = jnp.take_along_axis(ext, (n[:, None] + jnp.arange(width))[:, :, None], axis=1)
        g = decay_rate * jax.nn.softplus(a[tok].astype(jnp.float32) + dt_bias)  # [S, C, Hv]
        g = jnp.where(active[..., None], g, 0.0)
        beta = jnp.where(active[..., None], jax.nn.sigmoid(b[tok]).astype(jnp.float32), 0.0)
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))  # [S, Hv, C, D*]
        big_g = jnp.cumsum(g, axis=1).swapaxes(1, 2)  # [S, Hv, C]
        beta = beta.swapaxes(1, 2)
        diff = big_g[..., :, None] - big_g[..., None, :]  # [S, Hv, C, C]: G_t - G_i
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
        kk = jnp.einsum("shtd,shid->shti", k, k)
        lower = jnp.tril(beta[..., :, None] * decay * kk, -1)
        k_s0 = jnp.einsum("shtd,shdv->shtv", k, rec)
        rhs = beta[..., None] * (v - jnp.exp(big_g)[..., None] * k_s0)
        u = _unit_lower_solve(lower, rhs)
        o = jnp.exp(big_g)[..., None] * jnp.einsum("shtd,shdv->shtv", q, rec)
        o = o + jnp.einsum("shti,shiv->shtv", decay * jnp.einsum("shtd,shid->shti", q, k), u)
        last = big_g[..., -1:]  # G_C
        rec = jnp.exp(last)[..., None] * rec + jnp.einsum(
            "shtd,shtv->shdv", k * jnp.exp(last - big_g)[..., None], u
        )
        dest = jnp.where(active, start[:, None] + pos, num_tokens)
        out = out.at[dest].set(o.swapaxes(1, 2), mode="drop")
        return conv, rec, out

    num_v_heads, v_head_dim = rec.shape[1], rec.shape[3]
    out = jnp.zeros((num_tokens, num_v_heads, v_head_dim), jnp.float32)
    num_chunks = (jnp.max(q_len) + chunk - 1) // chunk
    conv, rec, out = jax.lax.fori_loop(0, num_chunks, body, (conv, rec, out))
    return out, conv, rec


class GatedDeltaNet(nnx.Module):
    """Weights as HF's Qwen3NextGatedDeltaNet: in_proj_qkvz [D, Hk (2 Dk + 2 r Dv)] and
    in_proj_ba [D, Hk 2r] (r = Hv / Hk; columns grouped per key head, as HF lays them out),
    conv1d [K, C] (its channels grouped per key head too: q, k, v of each; HF's are all
    q's, all k's, then all v's), dt_bias and A_log [Hv], norm [Dv] (the gated RMSNorm),
    out_proj [Hv Dv, D]. Under tensor parallelism every one of them but the norm is split by
    key heads (with their value heads), and so are the states (distributed/sharding.py)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, d, dt = config.linear_attn, config.hidden_size, config.dtype
        self.dims = c
        r = c.num_v_heads // c.num_k_heads
        # quantized as the decoder's other projections; in_proj_ba (a row per value head) in
        # full precision, as the published FP8 builds keep it
        q = config.linear_kwargs()
        width = c.num_k_heads * (2 * c.k_head_dim + 2 * r * c.v_head_dim)
        self.in_proj_qkvz = Linear(d, width, dtype=dt, rngs=rngs, **q)
        self.in_proj_ba = Linear(d, 2 * c.num_v_heads, dtype=dt, rngs=rngs)
        self.conv1d = nnx.Param(
            nnx.initializers.lecun_normal()(rngs.params(), (c.conv_kernel, c.conv_dim), dt)
        )
        self.dt_bias = nnx.Param(jnp.ones((c.num_v_heads,), jnp.float32))
        self.A_log = nnx.Param(jnp.zeros((c.num_v_heads,), jnp.float32))
        self.norm = nnx.Param(jnp.ones((c.v_head_dim,), dt))
        self.out_proj = Linear(c.num_v_heads * c.v_head_dim, d, dtype=dt, rngs=rngs, **q)
        self.eps = config.rms_norm_eps

    def __call__(self, x, positions, token_rows, md, conv_state, rec_state):
        """x: [T, D] -> ([T, D], conv_state, rec_state) (this layer's [N, ...] states)."""
        c, t = self.dims, x.shape[0]
        r = c.num_v_heads // c.num_k_heads
        qkvz = self.in_proj_qkvz(x).reshape(t, c.num_k_heads, -1)
        width = 2 * c.k_head_dim + r * c.v_head_dim  # a key head's q, k and v
        mixed, z = qkvz[..., :width].reshape(t, -1), qkvz[..., width:]
        ba = self.in_proj_ba(x).reshape(t, c.num_k_heads, 2 * r)
        b, a = ba[..., :r].reshape(t, -1), ba[..., r:].reshape(t, -1)  # [T, Hv]
        o, conv_state, rec_state = gated_delta_scan(
            mixed,
            a,
            b,
            self.conv1d[...],
            self.A_log[...],
            self.dt_bias[...],
            md.query_start_loc,
            md.num_seqs,
            token_rows,
            positions,
            conv_state,
            rec_state,
            num_k_heads=c.num_k_heads,
            k_head_dim=c.k_head_dim,
            v_head_dim=c.v_head_dim,
            chunk=None if md.decode_only else CHUNK,
        )
        o = rms_normalize(o, self.eps).astype(x.dtype) * self.norm[...]
        z = z.reshape(t, c.num_v_heads, c.v_head_dim).astype(jnp.float32)
        o = (o.astype(jnp.float32) * jax.nn.silu(z)).astype(x.dtype)
        return self.out_proj(o.reshape(t, -1)), conv_state, rec_state
