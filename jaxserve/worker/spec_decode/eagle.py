"""EAGLE-1 / EAGLE-3 drafting: a one-layer head drafts from the target's own hidden states.

The head's KV cache entry at position p holds [embedding of x_{p+1} ; f_p], f_p the target's
feature at p (EAGLE-1: its final hidden state; EAGLE-3: the inputs of three of its layers,
which the runner's forwards then return too; models/eagle.py), in the target's block layout
like a draft model's (spec_decode/draft_model.py). Every target forward is mirrored: token i of
the step (at position p_i) writes the entry at p_i - 1, pairing itself with the feature before
it: the previous token's in the same forward, or, for the first token of a request's tokens in
the step, the previous step's sampling row whose sample the request kept (the step state's
KEPT_ROW, worker/step_state.py). Where the request was not in the previous step (a prompt
resumed after a prefix-cache hit or a preemption) the entry is skipped: drafts may then be
worse, output never changes. Right after a step's sampling, on the devices, `propose` writes
the entry of the kept token x' at P - 1 with the target's feature of the row that sampled it,
and continues k - 1 more one-token steps, each feeding the head's own output as the next
feature; every draft is the argmax of an LM head on the head's output (EAGLE-1: the target's;
EAGLE-3: its own over a draft vocabulary, mapped to target ids).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.distributed.sharding import put
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models.eagle import Eagle3LlamaForCausalLM
from jaxserve.models.loader import LoadedModel
from jaxserve.worker.spec_decode.draft_model import (
    DraftModelProposer,
    proposal_layout,
    proposal_padding,
    shapes,
)
from jaxserve.worker.step_state import block_slots, kept_row_column, resolve, set_drafts

if TYPE_CHECKING:
    from jaxserve.worker.input_batch import InputBatch
    from jaxserve.worker.step_state import Settled
    from jaxserve.worker.step_types import StepBatch


class EagleProposer(DraftModelProposer):
    def __init__(
        self,
        head: LoadedModel,
        target,
        k: int,
        attention_backend: str,
        kv_sharding,
        block_size: int,
        seq_buckets: list[int],
        max_sample_rows: int,
    ):
        """head: the loaded EAGLE head; target: the target model (its embedding and LM head
        are shared, as vLLM shares them)."""
        super().__init__(head, k, attention_backend, kv_sharding, block_size, seq_buckets)
        self.embedding = target.embed_tokens.embedding[...]  # [V, D]
        self.lm_head = target.logits_head
        self.tied = target.config.tie_word_embeddings
        self.soft_cap = target.config.final_logit_softcapping
        self.max_sample_rows = max_sample_rows
        self.aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers of its feature
        self.feature_width = target.config.hidden_size
        if isinstance(head.model, Eagle3LlamaForCausalLM):
            self.aux_layers = Eagle3LlamaForCausalLM.aux_layers(
                head.config, target.config.num_layers
            )
            self.feature_width *= len(self.aux_layers)
        rep = self._replicated = NamedSharding(self.mesh, P())
        self._no_rows = put(
            np.zeros((max_sample_rows, self.feature_width), self.embedding.dtype), rep
        )
        self._mirror = jax.jit(self._mirror_fn, donate_argnums=(1,), out_shardings=kv_sharding)
        self._propose = jax.jit(
            self._propose_fn, donate_argnums=(1, 2), out_shardings=(rep, rep, kv_sharding)
        )
        self._rows = None  # the latest step's sampling rows' features [R, F], its requests

    # ------------------------------------------------------------------ compiled
    def _mirror_fn(
        self, params, kv_caches, state, embedding, hidden, prev_rows, inputs, before, prev_first
    ):
        """The head's entries of a target forward's tokens (inputs: its ForwardInputs, hidden
        [T, F] its features; prev_rows [R, F]: the previous step's sampling rows'). before:
        i32[T] each token's predecessor in the step (-1: a request's first token, or
        padding); prev_first: bool[T] a first token whose request was in the previous step."""
        inputs = resolve(inputs, state, self.block_size)
        md, t = inputs.attn.group_view(0), hidden.shape[0]  # the full-attention group's
        pos = inputs.positions - 1
        seq = jnp.searchsorted(md.query_start_loc[1:], jnp.arange(t), side="right")
        seq = jnp.minimum(seq, md.block_tables.shape[0] - 1)
        no_limit = jnp.full(t, md.block_tables.shape[1], jnp.int32)
        at_prev = block_slots(md.block_tables[seq], pos, no_limit, self.block_size)
        slots = jnp.where(before >= 0, md.slot_mapping[before], jnp.where(prev_first, at_prev, -1))
        kept_row = state[inputs.token_rows, kept_row_column(state)]
        feature_idx = jnp.where(before >= 0, before, jnp.where(prev_first, t + kept_row, 0))
        model = self._model(params)
        h = model.prepare(jnp.concatenate([hidden, prev_rows])[feature_idx])
        entry_md = md._replace(slot_mapping=slots, kv_lens=jnp.maximum(md.kv_lens - 1, 0))
        ids = inputs.input_ids
        _, _, kv_caches = model(embedding[ids], h, jnp.maximum(pos, 0), kv_caches, entry_md)
        return kv_caches

    def _propose_fn(
        self,
        params,
        kv_caches,
        state,
        settled: Settled,
        embedding,
        lm_head,
        rows_hidden,
        rows,
        block_tables,
        num_blocks,
        num_seqs,
    ):
        """Drafts after each request's kept token x' (settled: i32[Q] each, the first s used:
        its entry at kept_pos - 1 with the feature of rows_hidden [R, F]'s kept_row; rows,
        num_blocks: i32[s], block_tables: i32[s, B]) -> (state with the drafts of `rows`,
        drafts i32[s, k], kv_caches)."""
        model = self._model(params)
        s = block_tables.shape[0]
        tokens, positions = settled.kept[:s], settled.kept_pos[:s] - 1
        qsl = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_seqs[0])

        def one(carry, j):
            tokens, h, kv_caches = carry
            slot = block_slots(block_tables, positions + j, num_blocks, self.block_size)
            kv_lens = jnp.where(jnp.arange(s) < num_seqs[0], positions + j + 1, 0)
            md = AttentionMetadata(slot, block_tables, kv_lens, qsl, num_seqs, decode_only=True)
            out, h, kv_caches = model(embedding[tokens], h, positions + j, kv_caches, md)
            nxt = model.greedy(out, lm_head, tied=self.tied, soft_cap=self.soft_cap)
            return (nxt, h, kv_caches), nxt

        carry = (tokens, model.prepare(rows_hidden[settled.kept_row[:s]]), kv_caches)
        (_, _, kv_caches), drafts = lax.scan(one, carry, jnp.arange(self.k, dtype=jnp.int32))
        return set_drafts(state, rows, drafts.T), drafts.T, kv_caches

    # ------------------------------------------------------------------ start-up
    def lowerings(
        self, padding_forwards: dict, seq_buckets: list[int], max_blocks: int, state, settled
    ) -> dict:
        out = {}
        d = self.feature_width
        dtype = self.embedding.dtype
        rep = self._replicated
        rows = jax.ShapeDtypeStruct((self.max_sample_rows, d), dtype, sharding=rep)
        kv = shapes(self.kv_caches)
        for (t, decode_only), inputs in padding_forwards.items():
            hidden = jax.ShapeDtypeStruct((t, d), dtype, sharding=rep)
            out["draft_mirror", t, decode_only] = functools.partial(
                self._mirror.lower,
                self.params,
                kv,
                state,
                self.embedding,
                hidden,
                rows,
                inputs,
                np.full(t, -1, np.int32),
                np.zeros(t, bool),
            )
        for s in seq_buckets:
            out["draft_propose", s] = functools.partial(
                self._propose.lower,
                self.params,
                kv,
                state,
                settled,
                self.embedding,
                self.lm_head,
                rows,
                *proposal_padding(s, max_blocks),
            )
        return out

    # ------------------------------------------------------------------ a serving step
    def mirror(self, batch: StepBatch, features: jax.Array, feature_rows: jax.Array, state) -> None:
        """Write the head's entries for a dispatched target forward (features [T, F]: every
        token's; feature_rows [R, F]: the sampling rows')."""
        t, inputs = batch.num_tokens, batch.forward
        n = int(batch.num_scheduled.sum())
        starts = batch.qsl[: len(batch.req_ids)]
        before = np.full(t, -1, np.int32)
        before[:n] = np.arange(-1, n - 1, dtype=np.int32)
        before[starts] = -1
        prev_hidden, prev_reqs = self._rows if self._rows is not None else (self._no_rows, set())
        prev_first = np.zeros(t, bool)
        prev_first[starts] = [r in prev_reqs for r in batch.req_ids]
        self.kv_caches = self._executables["draft_mirror", t, inputs.attn.decode_only](
            self.params,
            self.kv_caches,
            state,
            self.embedding,
            features,
            prev_hidden,
            inputs,
            before,
            prev_first,
        )
        self._rows = (feature_rows, set(batch.req_ids))

    def propose(self, state, batch: StepBatch, settled: Settled, ib: InputBatch):
        """Drafts of the step's requests that sampled, from its sampling rows' features:
        dispatched (the fetch brings them back)."""
        layout = proposal_layout(batch, ib, self.seq_buckets)
        state, drafts, self.kv_caches = self._executables["draft_propose", layout[1].shape[0]](
            self.params,
            self.kv_caches,
            state,
            settled,
            self.embedding,
            self.lm_head,
            self._rows[0],
            *layout,
        )
        return state, drafts
