"""What the next step reads from the devices without the host knowing it: each input-batch
row's latest kept token and the drafts proposed after it, so the engine core can dispatch a
step before the one in flight is fetched (async scheduling), speculative decoding included.

The step state is i32[N, k + 3] (N input-batch rows, k draft tokens a request may run):
  column 0          KEPT: the row's latest kept token (the sample of its accepted position)
  columns 1 .. k    its drafts after it, from the proposer that followed that sampling
  column k + 1      SHIFT: how many drafts of its latest sampled step were rejected: the
                    positions the host counted for them that never happened
  column k + 2      KEPT_ROW: the sampling row of its latest step whose sample it kept (an
                    EAGLE head's feature for the next step's first token)

A token the host does not know yet is a placeholder in the step's input ids: -1 - j reads
column j of its row (-1: the kept token, -2 - j: draft j). Placeholders are the tokens of a
request scheduled before its previous step was fetched; the scheduler counted that step's
drafts as accepted, so its positions (and KV slots, its sequence's KV length) are the host's
minus SHIFT (`resolve`). `settle` is the sampling's side: acceptance and the state's update.

Shapes: T tokens, R sequences of the forward, S sampling rows, Q request slots (the largest
sequence bucket), N input-batch rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.models.step_inputs import StepInputs

NO_DRAFT = -(2**31)  # SettleInputs.verify of a row that verifies no draft


def num_columns(k: int) -> int:
    return k + 3


def shift_column(state: jax.Array) -> int:
    return state.shape[1] - 2


def kept_row_column(state: jax.Array) -> int:
    return state.shape[1] - 1


class SettleInputs(NamedTuple):
    """Per sampling row and per request of a step (host-built, padded)."""

    verify: jax.Array  # i32[S]: the draft each row's sample must equal (a token id, a
    # placeholder -1 - j of the row's state column j, NO_DRAFT: none)
    req_rows: jax.Array  # i32[Q]: each request's input-batch row (N: padding)
    req_first: jax.Array  # i32[Q]: its first sampling row
    req_drafts: jax.Array  # i32[Q]: its drafts this step
    req_sampled: jax.Array  # bool[Q]: the step keeps its sample (its last token ran)
    req_ahead: jax.Array  # bool[Q]: its tokens are placeholders (shifted by SHIFT)
    req_last_pos: jax.Array  # i32[Q]: the host's position of its last token this step


class Settled(NamedTuple):
    """Each request's outcome of a step, on the devices (i32[Q] each)."""

    accepted: jax.Array  # drafts accepted
    kept: jax.Array  # the kept token: the sample of row first + accepted
    kept_row: jax.Array  # that sampling row
    kept_pos: jax.Array  # the kept token's position (its KV is written by the next step)


def resolve(inputs: StepInputs, state: jax.Array, block_size: int) -> StepInputs:
    """The forward's inputs with each placeholder's token from the state and, with drafts
    (k > 0), the positions, KV slots and KV lengths of placeholder tokens moved back by
    their row's SHIFT."""
    ids, rows = inputs.input_ids, inputs.token_rows
    placeholder = ids < 0
    column = jnp.where(placeholder, -ids - 1, 0)
    inputs = inputs._replace(input_ids=jnp.where(placeholder, state[rows, column], ids))
    if state.shape[1] == num_columns(0):
        return inputs
    shift = jnp.where(placeholder, state[rows, shift_column(state)], 0)
    md = inputs.attn
    pos = inputs.positions - shift
    qsl = md.query_start_loc
    seq = jnp.searchsorted(qsl[1:], jnp.arange(ids.shape[0]), side="right")
    seq = jnp.minimum(seq, md.block_tables.shape[-2] - 1)
    block = md.block_tables[..., seq, pos // block_size]  # [T], or [G, T] per group
    slots = jnp.where(shift > 0, block * block_size + pos % block_size, md.slot_mapping)
    last = jnp.clip(qsl[1:] - 1, 0, ids.shape[0] - 1)  # each sequence's last token
    kv_lens = md.kv_lens - jnp.where(qsl[1:] > qsl[:-1], shift[last], 0)
    return inputs._replace(positions=pos, attn=md._replace(slot_mapping=slots, kv_lens=kv_lens))


def settle(state: jax.Array, sampled: jax.Array, inputs: SettleInputs) -> tuple[jax.Array, Settled]:
    """A step's acceptance from its samples (sampled: i32[S]) and the state it leaves:
    each request keeps its drafts while they equal its rows' samples, then the next sample;
    a request whose sample is kept gets KEPT and SHIFT; every request its KEPT_ROW."""
    s, n = sampled.shape[0], state.shape[0]
    k = state.shape[1] - num_columns(0)
    verify, rows = inputs.verify, inputs.req_rows
    safe_rows = jnp.minimum(rows, n - 1)
    if k:
        row_of = jnp.clip(inputs.req_first[:, None] + jnp.arange(k), 0, s - 1)  # [Q, k]
        want = verify[row_of]
        column = jnp.clip(-want - 1, 0, k)
        want = jnp.where((want < 0) & (want != NO_DRAFT), state[safe_rows[:, None], column], want)
        match = (want == sampled[row_of]) & (jnp.arange(k) < inputs.req_drafts[:, None])
        accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    else:
        accepted = jnp.zeros_like(inputs.req_first)
    kept_row = jnp.minimum(inputs.req_first + accepted, s - 1)
    kept = sampled[kept_row]
    old_shift = jnp.where(inputs.req_ahead, state[safe_rows, shift_column(state)], 0)
    rejected = inputs.req_drafts - accepted
    kept_pos = inputs.req_last_pos - old_shift - rejected + 1
    keep = jnp.where(inputs.req_sampled, rows, n)  # n: dropped
    state = state.at[keep, 0].set(kept, mode="drop")
    state = state.at[keep, shift_column(state)].set(rejected, mode="drop")
    state = state.at[rows, kept_row_column(state)].set(kept_row, mode="drop")
    return state, Settled(accepted, kept, kept_row, kept_pos)


def set_drafts(state: jax.Array, rows: jax.Array, drafts: jax.Array) -> jax.Array:
    """The proposer's drafts (i32[Q, k]) into columns 1 .. k of `rows` (i32[Q], N: none)."""
    k = drafts.shape[1]
    return state.at[rows[:, None], 1 + jnp.arange(k)].set(drafts, mode="drop")


def block_slots(
    block_tables: jax.Array, positions: jax.Array, num_blocks: jax.Array, block_size: int
) -> jax.Array:
    """i32[Q]: the KV slot of each request's `positions` (block_tables i32[Q, B]), -1 past
    its num_blocks (i32[Q]: blocks it holds; 0 for a request that writes nothing)."""
    index = positions // block_size
    block = jnp.take_along_axis(
        block_tables, jnp.clip(index, 0, block_tables.shape[1] - 1)[:, None], axis=1
    )[:, 0]
    inside = (index < num_blocks) & (positions >= 0)
    return jnp.where(inside, block * block_size + positions % block_size, -1)
