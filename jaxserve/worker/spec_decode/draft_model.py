"""Draft-model drafting: a smaller model of the target's vocabulary drafts k tokens greedily.

Its KV cache has the target's block layout (the same block ids, its own arrays), so the
scheduler's block tables serve both models and a prefix-cache hit holds the draft's keys as
well: every target forward is mirrored by a draft forward over the same tokens (`mirror`), so
the draft's cache holds every position the target's does. Once a step's drafts are verified,
`propose` runs the draft k times on one token per request (the kept token, then its own
argmax) in one compiled loop, whose attention is the decode path alone (every request has one
token); the scheduler allocates k lookahead slots for those writes.
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

if TYPE_CHECKING:
    from jaxserve.worker.input_batch import InputBatch
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
            self._propose_fn, donate_argnums=(1,), out_shardings=(rep, kv_sharding)
        )
        self.kv_caches: tuple[jax.Array, jax.Array] | None = None
        self._executables: Any = {}  # the runner's ExecutableRegistry, once compiled

    def _model(self, params):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, params))

    def _mirror_fn(self, params, kv_caches, inputs: ForwardInputs):
        """The target step's tokens through the draft: only its KV cache is kept."""
        ids = jnp.maximum(inputs.input_ids, 0)  # a placeholder's slot is rewritten later
        _, kv_caches = self._model(params)(
            text_inputs(ids, inputs.positions, inputs.attn), kv_caches
        )
        return kv_caches

    def _propose_fn(self, params, kv_caches, tokens, positions, block_tables, slots, num_seqs):
        """tokens, positions: i32[S], each request's kept token and its position; slots:
        i32[k, S], where the K/V of the token at positions + j goes (-1: nowhere) ->
        (drafts i32[S, k], kv_caches)."""
        model = self._model(params)
        s = tokens.shape[0]
        qsl = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_seqs[0])

        def one(carry, xs):
            tokens, kv_caches = carry
            j, slot = xs
            kv_lens = jnp.where(jnp.arange(s) < num_seqs[0], positions + j + 1, 0)
            md = AttentionMetadata(slot, block_tables, kv_lens, qsl, num_seqs, decode_only=True)
            hidden, kv_caches = model(text_inputs(tokens, positions + j, md), kv_caches)
            nxt = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
            return (nxt, kv_caches), nxt

        (_, kv_caches), drafts = lax.scan(
            one, (tokens, kv_caches), (jnp.arange(self.k, dtype=jnp.int32), slots)
        )
        return drafts.T, kv_caches

    # ------------------------------------------------------------------ start-up
    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        kv_heads = self.num_cache_kv_heads // self.mesh.shape["tp"]
        return 2 * c.num_layers * block_size * kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        shape = (c.num_layers * num_blocks, block_size, self.num_cache_kv_heads, c.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, c.dtype), out_shardings=self._kv_sharding)
        self.kv_caches = (zeros(), zeros())

    def lowerings(self, padding_forwards: dict, seq_buckets: list[int], max_blocks: int) -> dict:
        """Mirrors (one per forward of the runner's: {(token bucket, decode_only): its padding
        inputs}) and proposal loops (one per sequence bucket), for the runner to compile with
        its own."""
        out = {}
        kv = shapes(self.kv_caches)
        for (t, decode_only), inputs in padding_forwards.items():
            out["draft_mirror", t, decode_only] = functools.partial(
                self._mirror.lower, self.params, kv, inputs
            )
        for s in seq_buckets:
            zeros = np.zeros(s, np.int32)
            out["draft_propose", s] = functools.partial(
                self._propose.lower,
                self.params,
                kv,
                zeros,
                zeros,
                np.zeros((s, max_blocks), np.int32),
                np.full((self.k, s), -1, np.int32),
                np.zeros(1, np.int32),
            )
        return out

    def set_executables(self, executables) -> None:
        self._executables = executables

    # ------------------------------------------------------------------ a serving step
    def mirror(self, batch: StepBatch, features=None, feature_rows=None) -> None:
        """The target's forward inputs through the draft (decode-only or not, as the
        target's)."""
        inputs = batch.forward
        mirror = self._executables["draft_mirror", batch.num_tokens, inputs.attn.decode_only]
        self.kv_caches = mirror(self.params, self.kv_caches, inputs)

    def propose_rows(self, ib: InputBatch, rows: np.ndarray, sample_rows=None) -> list[list[int]]:
        """Greedy drafts of the input batch's `rows` (each after its latest token): one
        compiled loop of k one-token steps, and this step's second host sync."""
        n = len(rows)
        if not n:
            return []
        positions = ib.num_tokens[rows] - 1
        tokens = ib.token_ids[rows, positions]
        s, pad, tables = self._proposal_layout(ib, rows, positions)
        drafts, self.kv_caches = self._executables["draft_propose", s](
            self.params,
            self.kv_caches,
            np.pad(tokens, pad),
            np.pad(positions, pad),
            *tables,
        )
        return np.asarray(drafts)[:n].tolist()

    def _proposal_layout(self, ib: InputBatch, rows: np.ndarray, positions: np.ndarray):
        """The proposal loop's sequence bucket s, the padding of its [n] arrays to s, and its
        (block tables i32[s, max_blocks], slots i32[k, s], num_seqs i32[1]): where the K/V of
        the token at positions + j goes (-1: nowhere)."""
        n = len(rows)
        s = bucket(self.seq_buckets, n)
        block_tables = ib.block_table[rows]
        pos = positions[None, :] + np.arange(self.k, dtype=np.int32)[:, None]  # [k, n]
        bs = self.block_size
        block = np.minimum(pos // bs, block_tables.shape[1] - 1)
        ids = np.take_along_axis(block_tables.T, block, axis=0)
        # Lookahead blocks were allocated up to max_model_len; past them nothing is written.
        slots = np.where(pos // bs < ib.num_blocks[rows][None, :], ids * bs + pos % bs, -1)
        pad = (0, s - n)
        tables = (
            np.pad(block_tables, (pad, (0, 0))),
            np.pad(slots, ((0, 0), pad), constant_values=-1),
            np.array([n], np.int32),
        )
        return s, pad, tables
