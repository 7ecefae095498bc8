"""Draft-model drafting: a smaller model of the target's vocabulary drafts k tokens greedily.

Its KV cache has the target's block layout (the same block ids, its own arrays), so the
scheduler's block tables serve both models and a prefix-cache hit holds the draft's keys as
well: every target forward is mirrored by a draft forward over the same tokens (`mirror`), so
the draft's cache holds every position the target's does. Right after a step's sampling, on
the devices (its outcome: worker/step_state.py's Settled), `propose` runs the draft k times
on one token per request (the kept token, then its own argmax) in one compiled loop, whose
attention is the decode path alone (every request has one token); the scheduler allocates k
lookahead slots for those writes.
Greedy drafts are single tokens, so the runner's acceptance rule stays exact.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.layers.attention import AttentionMetadata, configure_attention
from jaxserve.layers.fused_moe import configure_moe
from jaxserve.models.loader import LoadedModel
from jaxserve.models.step_inputs import text_inputs
from jaxserve.worker.buckets import bucket
from jaxserve.worker.spec_decode.proposer import Proposer
from jaxserve.worker.step_state import block_slots, resolve, set_drafts

if TYPE_CHECKING:
    from jaxserve.worker.input_batch import InputBatch
    from jaxserve.worker.step_state import Settled
    from jaxserve.worker.step_types import ForwardInputs, StepBatch


def shapes(tree: Any) -> Any:
    """`tree`'s arrays as ShapeDtypeStructs with their shardings: what a lowering that may run
    later (in compile_all's background thread) captures instead of arrays a step donates."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class DraftModelProposer(Proposer):
    def __init__(
        self,
        loaded: LoadedModel,
        k: int,
        attention_backend: str,
        kv_sharding,
        block_size: int,
        seq_buckets: list[int],
    ):
        self.k, self.block_size, self.seq_buckets = k, block_size, seq_buckets
        self.num_speculative_tokens = k
        self.config = loaded.config
        self.mesh = loaded.mesh
        configure_attention(loaded.model, attention_backend, self.mesh)
        configure_moe(loaded.model, self.mesh)
        self.num_cache_kv_heads = loaded.model.num_cache_kv_heads
        self.graphdef, state = nnx.split(loaded.model)
        self.params, self._params_def = jax.tree.flatten(state)
        self._kv_sharding = kv_sharding
        rep = NamedSharding(self.mesh, P())
        self._mirror = jax.jit(self._mirror_fn, donate_argnums=(1,), out_shardings=kv_sharding)
        self._propose = jax.jit(
            self._propose_fn, donate_argnums=(1, 2), out_shardings=(rep, rep, kv_sharding)
        )
        self.kv_caches: tuple[jax.Array, jax.Array] | None = None
        self._executables: Any = {}  # the runner's ExecutableRegistry, once compiled

    def _model(self, params):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, params))

    def _mirror_fn(self, params, kv_caches, state, inputs: ForwardInputs):
        """The target step's tokens through the draft: only its KV cache is kept, in the
        blocks of the target's first KV-cache group (full attention: every position)."""
        inputs = resolve(inputs, state, self.block_size)
        md = inputs.attn.group_view(0)
        _, kv_caches = self._model(params)(
            text_inputs(inputs.input_ids, inputs.positions, md), kv_caches
        )
        return kv_caches

    def _propose_fn(
        self, params, kv_caches, state, settled: Settled, rows, block_tables, num_blocks, num_seqs
    ):
        """Greedy drafts after each request's kept token (settled: i32[Q] each, the first s
        used; rows, num_blocks: i32[s], block_tables: i32[s, B], num_seqs: i32[1]) ->
        (state with the drafts of `rows` (N: none), drafts i32[s, k], kv_caches)."""
        model = self._model(params)
        s = block_tables.shape[0]
        tokens, positions = settled.kept[:s], settled.kept_pos[:s]
        qsl = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_seqs[0])

        def one(carry, j):
            tokens, kv_caches = carry
            slot = block_slots(block_tables, positions + j, num_blocks, self.block_size)
            kv_lens = jnp.where(jnp.arange(s) < num_seqs[0], positions + j + 1, 0)
            md = AttentionMetadata(slot, block_tables, kv_lens, qsl, num_seqs, decode_only=True)
            hidden, kv_caches = model(text_inputs(tokens, positions + j, md), kv_caches)
            nxt = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
            return (nxt, kv_caches), nxt

        (_, kv_caches), drafts = lax.scan(
            one, (tokens, kv_caches), jnp.arange(self.k, dtype=jnp.int32)
        )
        return set_drafts(state, rows, drafts.T), drafts.T, kv_caches

    # ------------------------------------------------------------------ start-up
    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        kv_heads = self.num_cache_kv_heads // self.mesh.shape["tp"]
        layers = len(c.kv_layers)  # (Gemma 4's KV-sharing layers hold none)
        return 2 * layers * block_size * kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        shape = (len(c.kv_layers) * num_blocks, block_size, self.num_cache_kv_heads, c.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, c.dtype), out_shardings=self._kv_sharding)
        self.kv_caches = (zeros(), zeros())

    def lowerings(
        self, padding_forwards: dict, seq_buckets: list[int], max_blocks: int, state, settled
    ) -> dict:
        """Mirrors (one per forward of the runner's: {(token bucket, decode_only): its padding
        inputs}) and proposal loops (one per sequence bucket), for the runner to compile with
        its own (state, settled: the step state's and a sampling outcome's shapes)."""
        out = {}
        kv = shapes(self.kv_caches)
        for (t, decode_only), inputs in padding_forwards.items():
            out["draft_mirror", t, decode_only] = functools.partial(
                self._mirror.lower, self.params, kv, state, inputs
            )
        for s in seq_buckets:
            out["draft_propose", s] = functools.partial(
                self._propose.lower,
                self.params,
                kv,
                state,
                settled,
                *proposal_padding(s, max_blocks),
            )
        return out

    def set_executables(self, executables) -> None:
        self._executables = executables

    # ------------------------------------------------------------------ a serving step
    def mirror(self, batch: StepBatch, features, feature_rows, state) -> None:
        """The target's forward inputs through the draft (decode-only or not, as the
        target's)."""
        inputs = batch.forward
        mirror = self._executables["draft_mirror", batch.num_tokens, inputs.attn.decode_only]
        self.kv_caches = mirror(self.params, self.kv_caches, state, inputs)

    def propose(self, state, batch: StepBatch, settled: Settled, ib: InputBatch):
        """Greedy drafts of the step's requests that sampled: one compiled loop of k
        one-token steps, dispatched (the fetch brings them back)."""
        layout = proposal_layout(batch, ib, self.seq_buckets)
        state, drafts, self.kv_caches = self._executables["draft_propose", layout[1].shape[0]](
            self.params, self.kv_caches, state, settled, *layout
        )
        return state, drafts


def proposal_layout(batch: StepBatch, ib: InputBatch, seq_buckets) -> tuple[np.ndarray, ...]:
    """A proposal loop's host inputs over the step's requests, padded to a sequence bucket s:
    (rows i32[s]: each one's input-batch row, N where it did not sample (its drafts are
    dropped); block_tables i32[s, B]; num_blocks i32[s]: blocks it holds, 0 where nothing
    is written; num_seqs i32[1])."""
    n = len(batch.req_ids)
    s = bucket(seq_buckets, n)
    proposes = batch.sampled.copy()
    for i in np.flatnonzero(proposes):
        proposes[i] = ib.holds(batch.req_ids[i], batch.rows[i])
    rows = np.full(s, ib.max_num_reqs, np.int32)
    rows[:n] = np.where(proposes, batch.rows, ib.max_num_reqs)
    tables = np.zeros((s, ib.block_table.shape[2]), np.int32)
    tables[:n] = ib.block_table[0, batch.rows]  # the first KV-cache group's: full attention
    num_blocks = np.zeros(s, np.int32)
    num_blocks[:n] = np.where(proposes, ib.num_blocks[batch.rows], 0)
    return rows, tables, num_blocks, np.array([n], np.int32)


def proposal_padding(s: int, max_blocks: int) -> tuple[np.ndarray, ...]:
    """proposal_layout's shapes for sequence bucket s (what start-up lowers with)."""
    zeros = np.zeros(s, np.int32)
    return zeros, np.zeros((s, max_blocks), np.int32), zeros, np.zeros(1, np.int32)
