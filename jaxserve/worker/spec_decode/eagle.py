"""EAGLE-1 / EAGLE-3 drafting: a one-layer head drafts from the target's own hidden states.

The head's KV cache entry at position p holds [embedding of x_{p+1} ; f_p], f_p the target's
feature at p (EAGLE-1: its final hidden state; EAGLE-3: the inputs of three of its layers,
which the runner's forwards then return too; models/eagle.py), in the target's block layout
like a draft model's (spec_decode/draft_model.py). Every target forward is mirrored: token i of
the step (at position p_i) writes the entry at p_i - 1, pairing itself with the feature before
it: the previous token's in the same forward, or, for the first token of a request's tokens in
the step, one of the previous step's sampling rows (every request has one at its last token,
plus one per draft). Where that position was not a row of the previous step (a prompt resumed
after a prefix-cache hit or a preemption) the entry is skipped: drafts may then be worse,
output never changes. Once a step's drafts are verified, `propose_rows` writes the entry of
the kept token x' at P - 1 with the target's feature of the row that sampled it, and continues
k - 1 more one-token steps, each feeding the head's own output as the next feature; every
draft is the argmax of an LM head on the head's output (EAGLE-1: the target's; EAGLE-3: its
own over a draft vocabulary, mapped to target ids).
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
from jaxserve.worker.spec_decode.draft_model import DraftModelProposer, shapes

if TYPE_CHECKING:
    from jaxserve.worker.input_batch import InputBatch
    from jaxserve.worker.step_types import StepBatch


def rows_by_request(batch: StepBatch) -> dict[str, tuple[int, int, int]]:
    """Each request's (first sampling row, the position that row's hidden state is at,
    number of rows: 1 + its drafts, at consecutive positions) in a step."""
    first_pos = batch.start + batch.num_scheduled - batch.num_rows
    return {
        r: (int(f), int(p), int(n))
        for r, f, p, n in zip(
            batch.req_ids, batch.first_row, first_pos, batch.num_rows, strict=True
        )
    }


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
            self._propose_fn, donate_argnums=(1,), out_shardings=(rep, kv_sharding)
        )
        self._rows = None  # the latest step's sampling rows: (hidden [R, D], {req_id: ...})

    # ------------------------------------------------------------------ compiled
    def _mirror_fn(
        self,
        params,
        kv_caches,
        embedding,
        hidden,
        prev_rows,
        ids,
        positions,
        feature_idx,
        md: AttentionMetadata,
    ):
        """ids, positions: i32[T] each entry's token and position; feature_idx: i32[T] into
        [this step's hidden [T, D] ; the previous step's sampling rows [R, D]]."""
        model = self._model(params)
        h = model.prepare(jnp.concatenate([hidden, prev_rows])[feature_idx])
        _, _, kv_caches = model(embedding[ids], h, positions, kv_caches, md)
        return kv_caches

    def _propose_fn(
        self,
        params,
        kv_caches,
        embedding,
        lm_head,
        rows_hidden,
        tokens,
        positions,
        feature_rows,
        block_tables,
        slots,
        num_seqs,
    ):
        """tokens: i32[S] each request's kept token x'; positions: i32[S] its position - 1;
        feature_rows: i32[S] the sampling row (of rows_hidden [R, D]) that sampled it; slots:
        i32[k, S] -> (drafts i32[S, k], kv_caches)."""
        model = self._model(params)
        s = tokens.shape[0]
        qsl = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_seqs[0])

        def one(carry, xs):
            tokens, h, kv_caches = carry
            j, slot = xs
            kv_lens = jnp.where(jnp.arange(s) < num_seqs[0], positions + j + 1, 0)
            md = AttentionMetadata(slot, block_tables, kv_lens, qsl, num_seqs, decode_only=True)
            out, h, kv_caches = model(embedding[tokens], h, positions + j, kv_caches, md)
            nxt = model.greedy(out, lm_head, tied=self.tied, soft_cap=self.soft_cap)
            return (nxt, h, kv_caches), nxt

        carry = (tokens, model.prepare(rows_hidden[feature_rows]), kv_caches)
        (_, _, kv_caches), drafts = lax.scan(
            one, carry, (jnp.arange(self.k, dtype=jnp.int32), slots)
        )
        return drafts.T, kv_caches

    # ------------------------------------------------------------------ start-up
    def lowerings(self, padding_forwards: dict, seq_buckets: list[int], max_blocks: int) -> dict:
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
                self.embedding,
                hidden,
                rows,
                inputs.input_ids,
                inputs.positions,
                inputs.input_ids,
                inputs.attn,
            )
        for s in seq_buckets:
            zeros = np.zeros(s, np.int32)
            out["draft_propose", s] = functools.partial(
                self._propose.lower,
                self.params,
                kv,
                self.embedding,
                self.lm_head,
                rows,
                zeros,
                zeros,
                zeros,
                np.zeros((s, max_blocks), np.int32),
                np.full((self.k, s), -1, np.int32),
                np.zeros(1, np.int32),
            )
        return out

    # ------------------------------------------------------------------ a serving step
    def mirror(self, batch: StepBatch, features: jax.Array, feature_rows: jax.Array) -> None:
        """Write the head's entries for a dispatched target forward (features [T, F]: every
        token's; feature_rows [R, F]: the sampling rows')."""
        t, inputs = batch.num_tokens, batch.forward
        md = inputs.attn
        num_seqs = int(md.num_seqs[0])
        qsl = np.asarray(md.query_start_loc)
        positions = np.asarray(inputs.positions)
        slots = np.asarray(md.slot_mapping)
        n = int(qsl[num_seqs])
        first = np.zeros(t, bool)
        first[qsl[:num_seqs]] = True
        # Entry of token i at p_i - 1: the previous token's slot and hidden state, or, for a
        # request's first token, the previous step's sampling row at p_i - 1 (if it had one).
        entry_slots = np.full(t, -1, np.int32)
        entry_slots[1:n] = slots[: n - 1]
        feature_idx = np.zeros(t, np.int32)
        feature_idx[1:n] = np.arange(n - 1)
        prev_hidden, prev = self._rows if self._rows is not None else (None, {})
        for i, req_id in enumerate(batch.req_ids):
            q, pos = int(qsl[i]), int(positions[qsl[i]]) - 1
            entry_slots[q] = -1
            row = _row_at(prev.get(req_id), pos)
            if pos >= 0 and row is not None:
                feature_idx[q] = t + row
                table = md.block_tables[i]
                entry_slots[q] = table[pos // self.block_size] * self.block_size + (
                    pos % self.block_size
                )
        if prev_hidden is None:
            prev_hidden = self._no_rows
        entry_md = md._replace(
            slot_mapping=entry_slots,
            kv_lens=np.maximum(np.asarray(md.kv_lens) - 1, 0),
        )
        self.kv_caches = self._executables["draft_mirror", t, md.decode_only](
            self.params,
            self.kv_caches,
            self.embedding,
            features,
            prev_hidden,
            np.asarray(inputs.input_ids).clip(0),
            np.maximum(positions - 1, 0),
            feature_idx,
            entry_md,
        )
        self._rows = (feature_rows, rows_by_request(batch))

    def propose_rows(
        self, ib: InputBatch, rows: np.ndarray, sample_rows: np.ndarray
    ) -> list[list[int]]:
        """Greedy drafts of the input batch's `rows`; sample_rows: the sampling row that
        sampled each one's latest token, in the step just verified."""
        n = len(rows)
        if not n:
            return []
        positions = ib.num_tokens[rows] - 2  # the kept token's entry: one before it
        tokens = ib.token_ids[rows, positions + 1]
        s, pad, tables = self._proposal_layout(ib, rows, positions)
        drafts, self.kv_caches = self._executables["draft_propose", s](
            self.params,
            self.kv_caches,
            self.embedding,
            self.lm_head,
            self._rows[0],
            np.pad(tokens, pad),
            np.pad(positions, pad),
            np.pad(sample_rows, pad),
            *tables,
        )
        return np.asarray(drafts)[:n].tolist()


def _row_at(rows: tuple[int, int, int] | None, pos: int) -> int | None:
    """rows: a request's (first sampling row, its position, number of rows) in a step -> the
    row holding the hidden state at `pos`, if one does."""
    if rows is None:
        return None
    first, first_pos, count = rows
    return first + pos - first_pos if 0 <= pos - first_pos < count else None
