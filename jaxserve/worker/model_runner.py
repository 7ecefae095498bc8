"""Runs one scheduler step on the devices: a forward executable, then a sampling executable.

Start-up: split the model once into a graphdef and a flat list of parameter arrays, so each
step calls a compiled executable on a fixed argument list; size the KV cache from a memory
budget after the weights are placed; then lower every step shape and compile them all in
parallel threads (XLA compiles outside the GIL), with the persistent compilation cache on:
  forward        one per token bucket T: the model over T tokens (its sequence metadata padded
                 to min(T, max_num_seqs) rows), returning the hidden state of each sampling
                 row ([max_sample_rows, D]) and of every token ([T, D]); with the Pallas
                 attention a second, decode-only one per bucket a decode step can fall in
                 (T up to max_num_seqs' bucket; T = 1 has only that one), so no step holds
                 both attention kernels (DECODE_ONLY_FORWARDS);
  sample         one per (row bucket S, SamplerVariant): LM head on the first S rows and
                 the sampler's passes for that variant (layers/sampler.py), which also updates
                 the device-resident penalty state and each row's last sampled token;
  prompt logprobs one per token bucket, dispatched only when a request asks.
Serving calls only these executables (a missing one is a bug, never a compile).

A step: build the flat batch from the persistent InputBatch with numpy, pad it to the smallest
buckets that fit, pick the cheapest compiled sampler variant that covers the batch's sampling
parameters, and dispatch forward + sample (the KV cache is donated and updated in place);
`fetch` later brings back only the sampled ids (and logprobs when a request asked), in one host
sync. Between the two the engine core schedules and dispatches the next step: a token still
being sampled is a placeholder (-1) in the input batch, and the forward reads it from the
device (`last_tokens`, each row's latest sampled token).

Speculative decoding: a request with draft tokens runs its last token and the drafts, and every
one of those positions is a sampling row (max_sample_rows = max_num_seqs * (1 + k), capped by
the token budget), sampled exactly as it would be without speculation: the draft at position j
is accepted while it equals row j's sample, and the first row that disagrees (or the row after
the last draft) gives the request's next token. For a draft that is a single token (ngram),
this is the rejection sampler itself: accepted with probability p_j(draft), and otherwise a
sample of p_j conditioned on not being the draft, i.e. p_j with the draft removed, renormalised;
a seeded request's rows even draw the same uniforms as without speculation. What a row's
sampling depends on beyond its position is what it would be there: a penalised row counts the
drafts before it as output (`SampleInputs.prior_drafts`), a constrained row gets the grammar's
mask after them, and each accepted position reports its own logprobs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.distributed.sharding import kv_cache_sharding, put
from jaxserve.layers.attention import AttentionMetadata, configure_attention
from jaxserve.layers.fused_moe import configure_moe
from jaxserve.layers.sampler import (
    COMPILED_VARIANTS,
    FULL_VARIANT,
    MAX_BIAS_TOKENS,
    SamplerVariant,
    SamplingMetadata,
    compute_prompt_logprobs,
    pick_variant,
    sample,
)
from jaxserve.models.llama import lm_logits
from jaxserve.models.loader import LoadedModel
from jaxserve.spec_decode import DraftModelProposer, EagleProposer, NgramProposer, StepRows
from jaxserve.spec_decode.backoff import DraftBackoff
from jaxserve.structured_output import bitmask_words
from jaxserve.worker import executable_cache, kv_block_io
from jaxserve.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 1
MIN_SEQ_BUCKET = 1
CPU_DEFAULT_KV_BYTES = 1 << 30  # host memory for the KV cache when no budget is given
PROMPT_LOGPROBS_CHUNK = 256  # positions whose [chunk, V] logits are live at once
# Per attention backend: whether a decode-only step (every scheduled request has one new
# token; no drafts) runs a forward of its own, whose attention is the decode path alone. The
# Pallas kernel's paths are two kernels: a forward choosing between them by lax.cond compiled
# both into every step. The reference's decode-only forward was no faster on CPU (SmolLM2,
# 2 cores, batch 8 / 32 at contexts 96 / 480: 0.96-1.01x the general forward's time;
# benchmarks/results/cpu.md), so it keeps one forward per bucket and compiles no more; so
# does the CPU kernel backend, whose general forward runs the reference's prefill path.
DECODE_ONLY_FORWARDS = {"pallas": True, "cpu": False, "reference": False}
# The executables compiled per token bucket (name[1]): a step of T tokens runs them at T's.
TOKEN_BUCKET_STEPS = ("forward", "prompt_logprobs", "pool")


def power_of_two_buckets(smallest: int, largest: int) -> list[int]:
    """smallest, 2*smallest, ... up to and always including largest."""
    buckets, b = [], min(smallest, largest)
    while b < largest:
        buckets.append(b)
        b *= 2
    return [*buckets, largest]


def compile_cache_dir() -> str:
    """$JAXSERVE_COMPILE_CACHE, or ~/.cache/jaxserve/xla: jax's persistent compilation cache,
    and the runner's saved executables under its `executables/`."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")
    return os.environ.get("JAXSERVE_COMPILE_CACHE", default)


def enable_persistent_compilation_cache() -> None:
    jax.config.update("jax_compilation_cache_dir", compile_cache_dir())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    executable_cache.watch_cache_reads()


class _CompileCounter:
    """Every compilation this process asks XLA for (persistent-cache hits included): serving
    must not add one. A jax.monitoring listener, registered once for the process."""

    count = 0

    @classmethod
    def listen(cls, event: str, **_) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            cls.count += 1


jax.monitoring.register_event_listener(_CompileCounter.listen)


def num_compilations() -> int:
    """Compilations requested in this process so far (the persistent cache must be on)."""
    return _CompileCounter.count


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, engine_config: EngineConfig, draft: LoadedModel | None = None
    ):
        """draft: the draft model of speculative method draft_model, on the same mesh."""
        scheduler_config, cache_config = engine_config.scheduler, engine_config.cache
        self.engine_config = engine_config
        self.config = loaded.config
        self.mesh = loaded.mesh
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_dtype = cache_config.kv_dtype(self.config.dtype)
        self.max_model_len = scheduler_config.max_model_len
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.token_buckets = power_of_two_buckets(
            MIN_TOKEN_BUCKET, scheduler_config.max_num_batched_tokens
        )
        self.seq_buckets = power_of_two_buckets(MIN_SEQ_BUCKET, self.max_num_seqs)
        spec = engine_config.speculative
        self.drafter = None
        self.draft_backoff = DraftBackoff()
        self._kv_sharding = kv_cache_sharding(self.mesh)
        self.max_sample_rows = self.max_num_seqs  # one per request, plus one per draft token
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        if spec is not None:
            k = spec.num_speculative_tokens
            self.max_sample_rows = min(
                self.max_num_seqs * (1 + k),
                max(self.max_num_seqs, scheduler_config.max_num_batched_tokens),
            )
            backend = engine_config.attention_backend
            if spec.method == "ngram":
                self.drafter = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            elif spec.method in ("eagle", "eagle3"):
                self.drafter = EagleProposer(
                    draft, loaded.model, k, backend, self._kv_sharding, self.block_size,
                    self.seq_buckets, self.max_sample_rows,
                )  # fmt: skip
            else:
                self.drafter = DraftModelProposer(
                    draft, k, backend, self._kv_sharding, self.block_size, self.seq_buckets
                )
        self.sample_buckets = power_of_two_buckets(MIN_SEQ_BUCKET, self.max_sample_rows)
        if spec is not None:  # one request's decode with k drafts fills its buckets exactly
            width = 1 + spec.num_speculative_tokens
            if width < self.token_buckets[-1]:
                self.token_buckets = sorted({*self.token_buckets, width})
            if width < self.sample_buckets[-1]:
                self.sample_buckets = sorted({*self.sample_buckets, width})
        # An EAGLE-3 head's feature: the inputs of a few target layers, from every forward.
        self.aux_layers = getattr(self.drafter, "aux_layers", ())
        self.decode_only_forwards = DECODE_ONLY_FORWARDS[engine_config.attention_backend]
        self.num_logprobs = engine_config.max_logprobs
        self.input_batch = InputBatch(
            self.max_num_seqs, self.max_model_len, self.max_blocks_per_req
        )
        configure_attention(loaded.model, engine_config.attention_backend, self.mesh)
        configure_moe(loaded.model, self.mesh)
        self.num_cache_kv_heads = loaded.model.num_cache_kv_heads
        self.tied_head = self.config.tie_word_embeddings
        self.soft_cap = self.config.final_logit_softcapping
        self.head = loaded.model.logits_head  # [V, D] tied or [D, V]
        self.graphdef, state = nnx.split(loaded.model)
        self.params, self._params_def = jax.tree.flatten(state)
        self.base_key = jax.random.PRNGKey(engine_config.seed)
        self.step_count = 0
        self.kv_caches: tuple[jax.Array, jax.Array] | None = None
        self.num_blocks = 0
        self._replicated = NamedSharding(self.mesh, P())
        rep = self._replicated
        outs = (rep, rep, self._kv_sharding) + (rep, rep) * bool(self.aux_layers)
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,), out_shardings=outs)
        self._sample = jax.jit(
            self._sample_fn, static_argnames=("variant",), donate_argnums=(2, 3),
            out_shardings=rep,
        )  # fmt: skip
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_fn, out_shardings=rep)
        # A pooling runner (embeddings): every step also pools its prompt tokens' hidden states;
        # MEAN sums and CLS firsts are kept per request until its prompt ends (fetch()).
        self.pooler = engine_config.pooler
        self._pool = jax.jit(_pool_fn, static_argnames=("num_seqs",), out_shardings=rep)
        self._pool_acc: dict[str, list] = {}  # req_id -> [sum f32[D], first f32[D]]
        self._init_penalty_row = jax.jit(_init_penalty_row, donate_argnums=(0,), out_shardings=rep)
        # A KV connector's block copies (distributed/kv_transfer; set_kv_connector).
        self.kv_connector = None
        self.kv_copy_buckets: list[int] = []
        if engine_config.kv_transfer is not None:
            self.kv_copy_buckets = kv_block_io.copy_buckets(self.max_blocks_per_req)
            n_layers = self.config.num_layers
            self._kv_gather = jax.jit(
                functools.partial(kv_block_io.gather_blocks, num_layers=n_layers)
            )
            self._kv_scatter = jax.jit(
                functools.partial(kv_block_io.scatter_blocks, num_layers=n_layers),
                donate_argnums=(0,), out_shardings=(self._kv_sharding,) * 2,
            )  # fmt: skip
            self._kv_blocks_sharding = NamedSharding(self.mesh, P(None, None, None, None, TP_AXIS))
        self._compiled: dict[tuple, Any] = {}  # (kind, shape...) -> compiled executable
        self._background: threading.Thread | None = None  # compile_all's, while it runs
        self._token_bucket_shapes: list[tuple] = []  # the steps run per token bucket
        self._free_bitmasks: dict[int, np.ndarray] = {}
        # Penalty state per input-batch row, on the device: (prompt_mask bool[R, V],
        # output_counts i32[R, V]). A penalised request's row is filled once when it is
        # scheduled (_init_penalty_row); each step with penalties then adds its sampled tokens.
        r, v = self.max_num_seqs, self.config.vocab_size
        self.penalty_state = put((np.zeros((r, v), bool), np.zeros((r, v), np.int32)), rep)
        self.last_tokens = put(np.zeros(r, np.int32), rep)  # i32[R]

    @property
    def model(self) -> nnx.Module:
        """The model as the steps see it (its parameters are the runner's arrays)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, self.params))

    # ------------------------------------------------------------------ the compiled steps
    def _forward_fn(self, params, kv_caches, last_tokens, inputs: ForwardInputs):
        """The model over T tokens. Returns (hidden [R, D] of each sequence's last token,
        hidden [T, D] of every token, kv_caches with this step's K/V written)."""
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, params))
        # Placeholders (-1): tokens the previous step sampled, not yet seen by the host.
        input_ids = jnp.where(
            inputs.input_ids < 0, last_tokens[inputs.token_rows], inputs.input_ids
        )
        if self.aux_layers:  # + the EAGLE-3 features of every token and sampling row
            hidden, kv_caches, aux = model(
                input_ids, inputs.positions, kv_caches, inputs.attn, aux_layers=self.aux_layers
            )
            rows = inputs.logits_indices
            return hidden[rows], hidden, kv_caches, aux, aux[rows]
        hidden, kv_caches = model(input_ids, inputs.positions, kv_caches, inputs.attn)
        return hidden[inputs.logits_indices], hidden, kv_caches

    def _sample_fn(
        self, head, last_hidden, penalty_state, last_tokens, inputs: SampleInputs, *, variant
    ):
        """LM head and sampling for the first S rows of last_hidden [max_sample_rows, D]. Returns
        (SamplerOutput [S], penalty_state with this step's tokens counted, last_tokens)."""
        s = inputs.rows.shape[0]
        logits = lm_logits(last_hidden[:s], head, tied=self.tied_head, soft_cap=self.soft_cap)
        sampling = inputs.sampling
        prompt_mask, output_counts = penalty_state
        if variant.penalties:
            counts = output_counts[inputs.rows]
            if inputs.prior_drafts.shape[1]:  # a draft row's earlier drafts count as output
                vocab = counts.shape[1]
                prior = jnp.where(inputs.prior_drafts >= 0, inputs.prior_drafts, vocab)
                counts = counts.at[jnp.arange(s)[:, None], prior].add(1, mode="drop")
            sampling = sampling._replace(prompt_mask=prompt_mask[inputs.rows], output_counts=counts)
        key = jax.random.fold_in(self.base_key, inputs.step)
        sampled = sample(
            logits, sampling, key, num_logprobs=self.num_logprobs, variant=variant,
            want_logprobs=inputs.want_logprobs,
        )  # fmt: skip
        if variant.penalties:
            output_counts = output_counts.at[inputs.rows, sampled.token_ids].add(
                inputs.appends.astype(jnp.int32)
            )
        kept_rows = jnp.where(inputs.appends, inputs.rows, last_tokens.shape[0])  # R: dropped
        last_tokens = last_tokens.at[kept_rows].set(sampled.token_ids, mode="drop")
        return sampled, (prompt_mask, output_counts), last_tokens

    def _prompt_logprobs_fn(self, head, hidden: jax.Array, targets: jax.Array):
        """Logprob (and top-K) of the next prompt token at every position: hidden [T, D],
        targets i32[T] (-1: none) -> [T, K+1] x2, [T].

        Logits are computed PROMPT_LOGPROBS_CHUNK rows at a time: [T, V] at once would be
        gigabytes for an 8k-token step with a 128k vocabulary."""
        t, k = hidden.shape[0], self.num_logprobs
        chunk = min(t, PROMPT_LOGPROBS_CHUNK)
        padded = -(-t // chunk) * chunk
        h = jnp.pad(hidden, ((0, padded - t), (0, 0))).reshape(padded // chunk, chunk, -1)
        ids = jnp.pad(jnp.maximum(targets, 0), (0, padded - t)).reshape(-1, chunk)
        out = lax.map(
            lambda x: compute_prompt_logprobs(
                lm_logits(x[0], head, tied=self.tied_head, soft_cap=self.soft_cap),
                x[1],
                num_logprobs=k,
            ),
            (h, ids),
        )
        return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:t], out)

    # ------------------------------------------------------------------ start-up
    def kv_bytes_per_block(self) -> int:
        c = self.config
        kv_heads = self.num_cache_kv_heads // self.mesh.shape["tp"]
        itemsize = jnp.dtype(self.kv_dtype).itemsize
        size = 2 * c.num_layers * self.block_size * kv_heads * c.head_dim * itemsize
        if self.drafter is not None and self.drafter.needs_kv_cache:  # the same blocks' draft KV
            size += self.drafter.kv_bytes_per_block(self.block_size, self.drafter.config.dtype)
        return size

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block's K and V over all layers, as KV connectors move it."""
        c = self.config
        return (2, c.num_layers, self.block_size, self.num_cache_kv_heads, c.head_dim)

    def set_kv_connector(self, connector) -> None:
        """Load and save KV blocks for `connector` (distributed/kv_transfer) in every step."""
        if not self.kv_copy_buckets:
            raise RuntimeError("a KV connector needs EngineConfig.kv_transfer at start-up")
        self.kv_connector = connector

    def _load_kv_blocks(self, loads: list[tuple[int, np.ndarray]]) -> None:
        """Scatter host blocks into the KV cache (before the step's forward reads them)."""
        block_ids = [b for b, _ in loads]
        for ids, start, n in kv_block_io.chunks(block_ids, self.kv_copy_buckets):
            data = np.zeros((len(ids), *self.kv_block_shape), self.kv_dtype)
            data[:n] = np.stack([blk for _, blk in loads[start : start + n]])
            self.kv_caches = self._executable("kv_scatter", len(ids))(
                self.kv_caches, ids, put(data, self._kv_blocks_sharding)
            )
        self.kv_connector.note_loaded(len(loads))

    def _gather_kv_blocks(self, block_ids: list[int]) -> list[tuple[jax.Array, int]]:
        """Start copying blocks out of the KV cache: (device array, real count) per chunk."""
        out = []
        for ids, _, n in kv_block_io.chunks(block_ids, self.kv_copy_buckets):
            blocks = self._executable("kv_gather", len(ids))(self.kv_caches, ids)
            blocks.copy_to_host_async()
            out.append((blocks, n))
        return out

    def determine_num_blocks(self) -> int:
        """Blocks that fit the budget (per device), after weights and compiled steps."""
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        else:
            stats = self.mesh.devices.flat[0].memory_stats() or {}
            if "bytes_limit" in stats:
                used = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
                budget = int(stats["bytes_limit"] * cc.gpu_memory_utilization) - used
            else:
                budget = CPU_DEFAULT_KV_BYTES
        num_blocks = budget // self.kv_bytes_per_block()
        if num_blocks < self.max_blocks_per_req + 1:
            raise ValueError(
                f"KV cache budget of {budget / 2**20:.0f} MiB holds {num_blocks} blocks of "
                f"{self.block_size} tokens; max_model_len={self.max_model_len} needs "
                f"{self.max_blocks_per_req + 1}. Raise kv_cache_memory_bytes / "
                "gpu_memory_utilization or lower max_model_len."
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """K and V: [L * num_blocks, block_size, Hkv (x replicas), hd] each, zeros."""
        c = self.config
        shape = (c.num_layers * num_blocks, self.block_size, self.num_cache_kv_heads, c.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, self.kv_dtype), out_shardings=self._kv_sharding)
        self.kv_caches = (zeros(), zeros())
        self.num_blocks = num_blocks
        if self.drafter is not None and self.drafter.needs_kv_cache:
            self.drafter.initialize_kv_cache(num_blocks, self.block_size)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB, %s); maximum concurrency at "
            "max_model_len=%d: %.2fx",
            num_blocks, self.block_size, num_blocks * self.kv_bytes_per_block() / 2**20,
            jnp.dtype(self.kv_dtype).name,
            self.max_model_len, num_blocks * self.block_size / self.max_model_len,
        )  # fmt: skip

    def compile_all(self, background: bool = False) -> None:
        """Every step shape's executable, so no serving step ever compiles: loaded as saved by
        an earlier start with the same signature (executable_cache), or lowered and compiled in
        parallel threads (then saved).

        background: return once the shapes that can serve any step are ready (the forward and
        prompt logprobs of token buckets 1, 4, 16, .. and max_num_seqs', all-greedy and
        all-pass sampling, drafts); load or compile the rest in a background thread, each used
        as soon as it is ready (`_ready_token_bucket` pads a step to the next ready bucket,
        `max_step_tokens` grows with the larger buckets, `pick_variant` takes the cheapest
        ready sampler). Start-up is then about half as long cold; a step never waits on a
        compile, but until the rest is in, some steps pad more, prefill chunks are smaller and
        sampling may run more passes than it needs."""
        start = time.perf_counter()
        cache_dir, key = compile_cache_dir(), self._executables_key()
        devices = list(self.mesh.devices.flat)
        lowerings = self._lowerings()
        self._token_bucket_shapes = [n for n in lowerings if n[0] in TOKEN_BUCKET_STEPS]
        saved = executable_cache.read(cache_dir, key) or {}
        if not saved.keys() <= lowerings.keys():
            logger.warning("ignoring saved executables of other step shapes (key %s)", key)
            saved = {}
        loaded: set[tuple] = set()  # names loaded from the file
        now = [n for n in lowerings if not background or self._serves_any_step(n)]
        later = [n for n in lowerings if n not in set(now)]  # a token bucket's steps together
        later.sort(key=lambda n: n[1] if n[0] in TOKEN_BUCKET_STEPS else self.token_buckets[-1] + 1)
        hits = contextlib.ExitStack()  # persistent-cache hits, for save; open until all are in
        hit_bytes = hits.enter_context(executable_cache.CacheHits())

        def build(names: list[tuple], workers: int) -> None:
            nonlocal saved
            with executable_cache.no_gc():
                try:
                    on_file = [n for n in names if n in saved]
                    for name, exe in executable_cache.deserialize(saved, on_file, devices, workers):
                        self._compiled[name] = exe
                        loaded.add(name)
                except Exception as e:  # a jax that loads differently: compile the rest
                    logger.warning("could not load saved executables (%r); compiling", e)
                    saved = {n: saved[n] for n in loaded}
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    # Each compile starts as soon as its shape is lowered (here, holding the
                    # GIL), so lowering the next ones overlaps the compiles (forwards first).
                    compiling = {
                        n: pool.submit(lowerings[n]().compile) for n in names if n not in loaded
                    }
                    for name, future in compiling.items():
                        self._compiled[name] = future.result()

        def save() -> None:  # `saved`: the serialized bytes known good, of any shape
            compiled = {n: e for n, e in list(self._compiled.items()) if n not in saved}
            if compiled:
                saved.update(executable_cache.save(cache_dir, key, compiled, hit_bytes, saved))

        def finish() -> None:
            try:
                if later:  # what a stopped start compiled is kept
                    save()
                    build(later, workers=1)  # a core left to the serving steps
                save()
                if later:
                    logger.info(
                        "%d more step shapes ready (and saved) in the background, %.1f s "
                        "after start-up began compiling", len(later), time.perf_counter() - start,
                    )  # fmt: skip
            finally:
                hits.close()

        build(now, workers=os.cpu_count() or 1)
        if self.drafter is not None and self.drafter.needs_kv_cache:
            self.drafter.set_compiled(self._compiled)
        logger.info(
            "%s %d step shapes in %.1f s%s",
            "loaded" if loaded.issuperset(now) else "compiled", len(now),
            time.perf_counter() - start,
            f" ({len(later)} more in the background)" if later else "",
        )  # fmt: skip
        if later:
            self._background = threading.Thread(target=finish, daemon=True, name="compile")
            self._background.start()
        else:
            finish()

    def _serves_any_step(self, name: tuple) -> bool:
        """Whether step shape `name` is among those compile_all(background=True) waits for."""
        if name[0] in TOKEN_BUCKET_STEPS:  # 1, 4, 16, .. and max_num_seqs' bucket: a step
            # pads to the next of these until the buckets between are in
            top = self._token_bucket(min(self.max_num_seqs, self.token_buckets[-1]))
            t = name[1]
            return self.drafter is not None or t == top or (t < top and t.bit_length() % 2 == 1)
        if name[0] == "sample":
            return name[2] in (COMPILED_VARIANTS[0], FULL_VARIANT)
        return True

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for compile_all's background shapes; whether all are ready."""
        if self._background is not None:
            self._background.join(timeout)
        return not self.compiling

    @property
    def compiling(self) -> bool:
        """Whether compile_all's background thread is still loading or compiling shapes."""
        return self._background is not None and self._background.is_alive()

    def _ready_token_buckets(self) -> list[int]:
        """The token buckets whose steps are all ready (all once compile_all is done)."""
        if not self.compiling:
            return self.token_buckets
        missing = {n[1] for n in self._token_bucket_shapes if n not in self._compiled}
        return [t for t in self.token_buckets if t not in missing]

    def max_step_tokens(self) -> int:
        """The most tokens one step can schedule now: the largest ready token bucket."""
        return self._ready_token_buckets()[-1]

    def _ready_token_bucket(self, num_tokens: int) -> int:
        """The smallest ready token bucket holding num_tokens (while compile_all's background
        thread runs, some between the ready ones may not be)."""
        return next(t for t in self._ready_token_buckets() if t >= num_tokens)

    def _executables_key(self) -> str:
        """What the step executables depend on beyond the environment: the configuration
        (engine, model, draft) and the layout of every argument array."""
        drafter = self.drafter
        return executable_cache.signature(
            engine=repr(self.engine_config),
            model_files=executable_cache.file_stats(self.engine_config.model_path),
            model=repr(self.config),
            params=executable_cache.abstract((self.params, self.head, self.kv_caches)),
            state=executable_cache.abstract((self.penalty_state, self.last_tokens)),
            param_tree=str(self._params_def),
            draft=executable_cache.abstract(
                [getattr(drafter, a, None) for a in ("params", "kv_caches", "embedding")]
            ),
            draft_model=repr(getattr(drafter, "config", None)),
            mesh=repr(self.mesh),
            # a connector's block copies (their own file: a start without one stays warm)
            **({"kv_copies": repr(self.kv_copy_buckets)} if self.kv_copy_buckets else {}),
        )

    def _lowerings(self) -> dict[tuple, Callable[[], Any]]:
        """Every step shape's name -> a function lowering it (called in compile_all's
        background thread too: the donated state is captured as shapes, not arrays)."""
        rep = self._replicated
        d = self.config.hidden_size
        spec = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        kv, penalty, last = spec(self.kv_caches), spec(self.penalty_state), spec(self.last_tokens)
        last_hidden = jax.ShapeDtypeStruct(
            (self.max_sample_rows, d), self.config.dtype, sharding=rep
        )
        lowerings: dict[tuple, Callable[[], Any]] = {}
        for t, decode_only in self.forward_variants():
            lowerings["forward", t, decode_only] = functools.partial(
                self._forward.lower, self.params, kv, last, self._padding_forward(t, decode_only)
            )
        for t in self.token_buckets:
            hidden = jax.ShapeDtypeStruct((t, d), self.config.dtype, sharding=rep)
            lowerings["prompt_logprobs", t] = functools.partial(
                self._prompt_logprobs.lower, self.head, hidden, np.full(t, -1, np.int32)
            )
            if self.pooler is not None:
                idx = np.zeros(self.max_num_seqs, np.int32)
                lowerings["pool", t] = functools.partial(
                    self._pool.lower, hidden, np.zeros(t, np.int32), idx, idx,
                    num_seqs=self.max_num_seqs,
                )  # fmt: skip
        for s in self.sample_buckets:
            inputs = SampleInputs(
                self._sampling_metadata([], s)[0], np.zeros(s, np.int32), np.zeros(s, bool),
                np.bool_(False), np.int32(0), np.full((s, self.num_spec_tokens), -1, np.int32),
            )  # fmt: skip
            for variant in COMPILED_VARIANTS:
                lowerings["sample", s, variant] = functools.partial(
                    self._sample.lower, self.head, last_hidden, penalty, last, inputs,
                    variant=variant,
                )  # fmt: skip
        if self.drafter is not None and self.drafter.needs_kv_cache:
            padding = {v: self._padding_forward(*v) for v in self.forward_variants()}
            drafts = self.drafter.lower_all(padding, self.seq_buckets, self.max_blocks_per_req)
            lowerings.update({name: (lambda lo=lo: lo) for name, lo in drafts.items()})
        for n in self.kv_copy_buckets:
            ids = np.zeros(n, np.int32)
            blocks = jax.ShapeDtypeStruct(
                (n, *self.kv_block_shape), self.kv_dtype, sharding=self._kv_blocks_sharding
            )
            lowerings["kv_gather", n] = functools.partial(self._kv_gather.lower, kv, ids)
            lowerings["kv_scatter", n] = functools.partial(self._kv_scatter.lower, kv, ids, blocks)
        zero = np.int32(0)
        lowerings["init_penalty_row",] = functools.partial(
            self._init_penalty_row.lower,
            penalty, zero, np.zeros(self.max_model_len, np.int32), zero, zero,
        )  # fmt: skip
        return lowerings

    def _executable(self, *key) -> Any:
        try:
            return self._compiled[key]
        except KeyError:
            raise RuntimeError(f"no compiled step for {key}: compile_all() must cover it") from None

    def forward_variants(self) -> list[tuple[int, bool]]:
        """(token bucket, decode_only) of every forward: a general one per bucket, and where
        the backend has them (DECODE_ONLY_FORWARDS) a decode-only one per bucket a decode step
        can fall in (it has at most max_num_seqs tokens); a 1-token step is always a decode."""
        if not self.decode_only_forwards:
            return [(t, False) for t in self.token_buckets]
        top = self._token_bucket(min(self.max_num_seqs, self.token_buckets[-1]))
        decode = [(t, True) for t in self.token_buckets if t <= top]
        return decode + [(t, False) for t in self.token_buckets if t > 1]

    def _token_bucket(self, num_tokens: int) -> int:
        return next(b for b in self.token_buckets if b >= num_tokens)

    def _padding_forward(self, t: int, decode_only: bool = False) -> ForwardInputs:
        s = self._forward_seqs(t)
        ids = np.zeros(t, np.int32)
        md = AttentionMetadata(
            slot_mapping=np.full(t, -1, np.int32),
            block_tables=np.zeros((s, self.max_blocks_per_req), np.int32),
            kv_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            num_seqs=np.zeros(1, np.int32),
            decode_only=decode_only,
        )
        return ForwardInputs(ids, ids, ids, md, np.zeros(self.max_sample_rows, np.int32))

    def _forward_seqs(self, t: int) -> int:
        """Sequence rows of the forward's metadata at token bucket t: every sequence has at
        least one token, so min(t, max_num_seqs) rounded up to a sequence bucket."""
        return next(b for b in self.seq_buckets if b >= min(t, self.max_num_seqs))

    def dummy_step(self) -> None:
        """The smallest forward over padding (no KV written, nothing sampled), run to its
        end: a data-parallel engine with no work steps with the others (vLLM's dummy batch)."""
        t, decode_only = self._ready_token_bucket(1), self.decode_only_forwards
        outs = self._executable("forward", t, decode_only)(
            self.params, self.kv_caches, self.last_tokens, self._padding_forward(t, decode_only)
        )
        self.kv_caches = outs[2]
        jax.block_until_ready(outs[0])

    # ------------------------------------------------------------------ a serving step
    def dispatch(self, so: SchedulerOutput) -> PendingStep | None:
        """Apply the scheduler's changes to the input batch and start the step on the devices
        (asynchronously); None when nothing was scheduled."""
        ib = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            ib.remove_request(req_id)
            self._pool_acc.pop(req_id, None)
            self.draft_backoff.forget(req_id)
        starts = {}
        for new in so.scheduled_new_reqs:
            row = ib.add_request(new, new.eos_token_id)
            starts[new.req_id] = new.num_computed_tokens
            if _penalised(new.sampling_params):
                self.penalty_state = self._executable("init_penalty_row")(
                    self.penalty_state, np.int32(row), ib.token_ids[row],
                    ib.num_prompt_tokens[row], ib.num_tokens[row],
                )  # fmt: skip
        for cached in so.scheduled_cached_reqs:
            ib.append_blocks(ib.req_id_to_row[cached.req_id], cached.new_block_ids)
            starts[cached.req_id] = cached.num_computed_tokens

        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return None
        rows = np.array([ib.req_id_to_row[r] for r in req_ids], np.int32)
        n_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
        start = np.array([starts[r] for r in req_ids], np.int32)
        num_reqs, num_tokens = len(req_ids), int(n_sched.sum())
        # Sampling rows: one per request, then one more per draft token (speculative decoding).
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
        n_rows = np.array([1 + len(d) for d in drafts], np.int32)
        first_row = (np.cumsum(n_rows) - n_rows).astype(np.int32)
        num_rows = int(n_rows.sum())
        for row, d in zip(rows, drafts, strict=True):
            if d:  # the drafts are the inputs after the last known token
                ib.token_ids[row, ib.num_tokens[row] : ib.num_tokens[row] + len(d)] = d
        t = self._ready_token_bucket(num_tokens)
        sf = self._forward_seqs(t)
        s = next(b for b in self.sample_buckets if b >= num_rows)

        qsl = np.zeros(sf + 1, np.int32)
        qsl[1 : num_reqs + 1] = np.cumsum(n_sched)
        qsl[num_reqs + 1 :] = num_tokens
        row_of_token = np.repeat(rows, n_sched)  # [num_tokens]
        pos = np.arange(num_tokens, dtype=np.int32) - np.repeat(qsl[:num_reqs], n_sched)
        pos += np.repeat(start, n_sched)
        ids = np.zeros(t, np.int32)
        ids[:num_tokens] = ib.token_ids[row_of_token, pos]  # -1: a token still being sampled
        token_rows = np.zeros(t, np.int32)
        token_rows[:num_tokens] = row_of_token
        positions = np.zeros(t, np.int32)
        positions[:num_tokens] = pos
        slots = np.full(t, -1, np.int32)
        blocks = ib.block_table[row_of_token, pos // self.block_size]
        slots[:num_tokens] = blocks * self.block_size + pos % self.block_size
        block_tables = np.zeros((sf, self.max_blocks_per_req), np.int32)
        block_tables[:num_reqs] = ib.block_table[rows]
        kv_lens = np.zeros(sf, np.int32)
        kv_lens[:num_reqs] = start + n_sched
        # Each request's last n_rows tokens: the positions whose next token is sampled.
        row_offset = np.arange(num_rows, dtype=np.int32) - np.repeat(first_row, n_rows)
        logits_indices = np.zeros(self.max_sample_rows, np.int32)
        logits_indices[:num_rows] = np.repeat(qsl[1 : num_reqs + 1] - n_rows, n_rows) + row_offset
        # Every request has one new token (drafts make more): the decode-only forward.
        decode_only = self.decode_only_forwards and num_tokens == num_reqs
        md = AttentionMetadata(slots, block_tables, kv_lens, qsl, np.array([num_reqs], np.int32),
                               decode_only)  # fmt: skip
        forward_inputs = ForwardInputs(ids, positions, token_rows, md, logits_indices)

        # Prompt logprobs: the token at pos + 1 is the target of position pos, while in the prompt.
        targets = np.full(t, -1, np.int32)
        wants_prompt_lp = np.array([ib.params[r].prompt_logprobs is not None for r in rows])
        if wants_prompt_lp.any():
            in_prompt = np.repeat(wants_prompt_lp, n_sched) & (
                pos + 1 < ib.num_prompt_tokens[row_of_token]
            )
            next_ids = ib.token_ids[row_of_token, np.minimum(pos + 1, self.max_model_len - 1)]
            targets[:num_tokens] = np.where(in_prompt, next_ids, -1)

        params = [ib.params[r] for r in rows]
        sample_rows = np.repeat(rows, n_rows)
        sampling, has_bias = self._sampling_metadata(sample_rows, s, row_offset)
        # The step reaches the end of the tokens: its sample is kept (a drafted request's
        # kept token is known only after fetch(): the host writes it then).
        sampled = np.array([r in so.sampled_req_ids for r in req_ids], bool)
        kept = sampled & (n_rows == 1)
        appends = np.zeros(s, bool)
        appends[first_row[kept]] = True
        prior_drafts = np.full((s, self.num_spec_tokens), -1, np.int32)
        for i, d in enumerate(drafts):  # row first + j counts the first j drafts
            for j in range(1, len(d) + 1):
                prior_drafts[first_row[i] + j, :j] = d[:j]
        sample_inputs = SampleInputs(
            sampling, np.pad(sample_rows, (0, s - num_rows)), appends,
            np.bool_(any(p.logprobs is not None for p in params)), np.int32(self.step_count),
            prior_drafts,
        )  # fmt: skip

        kv_meta = so.kv_connector_metadata
        if kv_meta is not None and kv_meta.loads:
            self._load_kv_blocks(kv_meta.loads)
        outs = self._executable("forward", t, decode_only)(
            self.params, self.kv_caches, self.last_tokens, forward_inputs
        )
        last_hidden, hidden, self.kv_caches = outs[:3]
        kv_saves = None
        if kv_meta is not None and kv_meta.saves:  # read before the next step overwrites
            kv_saves = ([h for _, h in kv_meta.saves],
                        self._gather_kv_blocks([b for b, _ in kv_meta.saves]))  # fmt: skip
        features, feature_rows = outs[3:] if self.aux_layers else (hidden, last_hidden)
        if self.drafter is not None and self.drafter.needs_kv_cache:
            # The draft's cache follows the target's (an EAGLE head's from its hidden states).
            last_pos = positions[qsl[1 : num_reqs + 1] - 1]
            self.drafter.mirror(t, forward_inputs, StepRows(
                req_ids, features, feature_rows, first_row, last_pos - n_rows + 1, n_rows,
            ))  # fmt: skip
        pooled = None
        if self.pooler is not None:  # each request's sum, first and last hidden state
            seq_of_token = np.full(t, self.max_num_seqs, np.int32)  # padding: dropped
            seq_of_token[:num_tokens] = np.repeat(np.arange(num_reqs, dtype=np.int32), n_sched)
            first = np.zeros(self.max_num_seqs, np.int32)
            first[:num_reqs] = qsl[:num_reqs]
            last = logits_indices[: self.max_num_seqs]  # one row per request: no drafts
            pooled = self._executable("pool", t)(hidden, seq_of_token, first, last)
        self.step_count += 1
        # The sampled tokens are placeholders until fetch(): the next step reads them from
        # last_tokens on the device.
        append_rows = rows[kept]
        append_positions = ib.num_tokens[append_rows].copy()
        ib.token_ids[append_rows, append_positions] = -1
        ib.num_tokens[append_rows] += 1
        pending = PendingStep(
            req_ids, rows, kept, append_positions, qsl, start, targets,
            wants_prompt_lp, fetch=None, pooled=pooled, sampled=sampled, first_row=first_row,
            drafts=drafts, kv_saves=kv_saves,
            deferred=_DeferredSample(
                SamplerVariant.of(params)._replace(bias=has_bias), sample_inputs, last_hidden,
                hidden, t,
            ),
        )  # fmt: skip
        if so.structured_output_req_ids:
            return pending  # sampled once the grammars have seen every earlier token
        return self.dispatch_sample(pending, None)

    def dispatch_sample(self, pending: PendingStep, bitmask: np.ndarray | None) -> PendingStep:
        """Start a dispatched step's sampling; bitmask: i32[num_reqs, ceil(V/32)] (or None),
        the allowed tokens of each row (structured outputs)."""
        d = pending.deferred
        sample_inputs, needed = d.sample_inputs, d.needed
        if bitmask is not None:
            s = sample_inputs.rows.shape[0]
            padded = np.full((s, bitmask.shape[1]), -1, np.int32)
            padded[: bitmask.shape[0]] = bitmask  # every sampling row's, drafts' too
            sample_inputs = sample_inputs._replace(
                sampling=sample_inputs.sampling._replace(token_bitmask=padded)
            )
            needed = needed._replace(structured=True)
        s = sample_inputs.rows.shape[0]
        variant = pick_variant(needed, ready=lambda v: ("sample", s, v) in self._compiled)
        out, self.penalty_state, self.last_tokens = self._executable("sample", s, variant)(
            self.head, d.last_hidden, self.penalty_state, self.last_tokens, sample_inputs
        )
        fetch = {"ids": out.token_ids}
        if pending.pooled is not None:
            fetch["pooled"] = pending.pooled
        if needed.logprobs:
            fetch["logprobs"] = (out.logprobs, out.logprob_token_ids, out.sampled_rank)
        if pending.wants_prompt_lp.any():
            fetch["prompt_logprobs"] = self._executable("prompt_logprobs", d.num_tokens)(
                self.head, d.hidden, pending.targets
            )
        for leaf in jax.tree.leaves(fetch):
            leaf.copy_to_host_async()
        return pending._replace(fetch=fetch, deferred=None)

    def fetch(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a dispatched step and bring its results to the host: the step's one sync."""
        p, ib = pending, self.input_batch
        fetched = jax.device_get(p.fetch)
        if p.kv_saves is not None:  # saved before the step's outputs leave the engine
            hashes, chunks = p.kv_saves
            blocks = np.concatenate([np.asarray(b)[:n] for b, n in chunks])
            self.kv_connector.save_blocks(hashes, blocks)
        row_ids = np.asarray(fetched["ids"], np.int32)
        final_row, num_accepted = self._accept_drafts(p, row_ids)
        sampled = row_ids[final_row]  # each request's kept token
        # Fill the placeholders, unless the row has since gone to another request.
        kept = np.flatnonzero(p.appends)
        for i, pos in zip(kept, p.append_positions, strict=True):
            row, token = p.rows[i], sampled[i]
            if ib.req_id_to_row.get(p.req_ids[i]) == row:
                ib.token_ids[row, pos] = token
        prompt_logprobs = {}
        if "prompt_logprobs" in fetched:
            lp, lp_ids, ranks = fetched["prompt_logprobs"]
            qsl, targets = p.qsl, p.targets
            for i in np.flatnonzero(p.wants_prompt_lp):
                lo, hi = qsl[i], qsl[i + 1]
                valid = lo + int(np.sum(targets[lo:hi] >= 0))  # a prefix of the chunk
                if valid > lo:  # prompt positions start[i] + 1 ..
                    prompt_logprobs[p.req_ids[i]] = PromptLogprobs(
                        int(p.start[i]) + 1, lp[lo:valid], lp_ids[lo:valid], ranks[lo:valid]
                    )
        result = ModelRunnerOutput(p.req_ids, sampled)
        result.num_accepted_drafts = num_accepted
        result.prompt_logprobs = prompt_logprobs
        if "pooled" in fetched:
            result.pooled = self._pooled_outputs(p, *fetched["pooled"])
        if "logprobs" in fetched:
            lp, lp_ids, ranks = fetched["logprobs"]
            result.logprobs, result.logprob_token_ids, result.sampled_ranks = lp, lp_ids, ranks
            result.first_row = p.first_row
        if self.drafter is not None:
            result.spec_token_ids = self._propose(p, final_row)
        return result

    def _accept_drafts(self, p: PendingStep, row_ids: np.ndarray) -> tuple[np.ndarray, dict]:
        """Each request's row whose sample it keeps (i32[num_reqs]: after its accepted
        drafts) and, per drafted request, how many drafts it accepted; a drafted request's
        accepted tokens and kept token go into the input batch (row_ids: i32[S], every
        sampling row's sample)."""
        ib, final_row, num_accepted = self.input_batch, p.first_row.copy(), {}
        for i, drafts in enumerate(p.drafts):
            if not drafts:
                continue
            first = p.first_row[i]
            rejected = np.flatnonzero(row_ids[first : first + len(drafts)] != drafts)
            accepted = int(rejected[0]) if len(rejected) else len(drafts)
            final_row[i] = first + accepted
            num_accepted[p.req_ids[i]] = accepted
            self.draft_backoff.observe(p.req_ids[i], accepted)
            row = p.rows[i]
            if ib.req_id_to_row.get(p.req_ids[i]) == row:  # drafts[:accepted] are in place
                n = ib.num_tokens[row] + accepted
                ib.token_ids[row, n] = row_ids[first + accepted]
                ib.num_tokens[row] = n + 1
                if _penalised(ib.params[row]):  # its kept tokens were not counted in the step
                    self.penalty_state = self._executable("init_penalty_row")(
                        self.penalty_state, np.int32(row), ib.token_ids[row],
                        ib.num_prompt_tokens[row], ib.num_tokens[row],
                    )  # fmt: skip
        return final_row, num_accepted

    def _propose(self, p: PendingStep, final_row: np.ndarray) -> dict[str, list[int]]:
        """The next drafts of the step's requests that sampled a token and may be drafted
        (as many as fit before max_model_len with the token sampled after them); final_row:
        each request's sampling row whose sample it kept."""
        ib = self.input_batch
        chosen = [
            i for i in np.flatnonzero(p.sampled)
            if ib.req_id_to_row.get(p.req_ids[i]) == p.rows[i]
            and self.draft_backoff.should_draft(p.req_ids[i])
        ]  # fmt: skip
        rows = p.rows[chosen]
        out = {}
        proposed = self.drafter.propose_rows(ib, rows, final_row[chosen])
        for i, row, drafts in zip(chosen, rows, proposed, strict=True):
            drafts = drafts[: self.max_model_len - int(ib.num_tokens[row]) - 1]
            if drafts:
                out[p.req_ids[i]] = drafts
        return out

    def _pooled_outputs(self, p: PendingStep, sums, firsts, lasts) -> dict[str, np.ndarray]:
        """Accumulate a step's pooled hidden states ([max_num_seqs, D] each, in the step's
        request order) and return the vector of each request whose prompt ended: its last
        token's, the mean over its prompt, or its first token's (PoolerConfig.pooling_type)."""
        ib, kind, out = self.input_batch, self.pooler.pooling_type, {}
        for i, req_id in enumerate(p.req_ids):
            if p.start[i] == 0:  # the prompt's first chunk (again, after a preemption)
                self._pool_acc[req_id] = [np.zeros_like(sums[i]), firsts[i]]
            acc = self._pool_acc[req_id]
            acc[0] = acc[0] + sums[i]
            if p.appends[i]:  # the prompt ended in this step
                del self._pool_acc[req_id]
                if kind == "LAST":
                    out[req_id] = lasts[i]
                elif kind == "MEAN":
                    out[req_id] = acc[0] / ib.num_prompt_tokens[p.rows[i]]
                else:
                    out[req_id] = acc[1]
        return out

    def _free_bitmask(self, s: int) -> np.ndarray:
        """i32[s, ceil(V/32)] with every token allowed (a step without constrained rows: the
        variants that ignore the mask never even transfer it)."""
        if s not in self._free_bitmasks:
            self._free_bitmasks[s] = np.full((s, bitmask_words(self.config.vocab_size)), -1,
                                             np.int32)  # fmt: skip
        return self._free_bitmasks[s]

    def _sampling_metadata(
        self, rows, s: int, offsets: np.ndarray | None = None
    ) -> tuple[SamplingMetadata, bool]:
        """Per-row sampling arrays for `rows` (host row ids), padded to s rows, and whether
        any row has a logit bias now; the [S, V] penalty arrays come from the device-resident
        penalty state inside the step. offsets: i32[len(rows)], how many tokens (drafts) come
        between a row's request's known tokens and the token that row samples."""
        ib = self.input_batch
        f32 = lambda fill=0.0: np.full(s, fill, np.float32)  # noqa: E731
        temperature, top_p, min_p = f32(), f32(1.0), f32()
        presence, frequency, repetition = f32(), f32(), f32(1.0)
        top_k, out_pos = np.zeros(s, np.int32), np.zeros(s, np.int32)
        seeds, seeds_hi = np.zeros(s, np.uint32), np.zeros(s, np.uint32)  # a seed's 2 words
        has_seed = np.zeros(s, bool)
        bias_ids = np.full((s, MAX_BIAS_TOKENS), -1, np.int32)
        bias_vals = np.zeros((s, MAX_BIAS_TOKENS), np.float32)
        for i, row in enumerate(rows):
            p = ib.params[row]
            temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
            repetition[i] = p.repetition_penalty
            out_pos[i] = ib.num_output_tokens(row) + (0 if offsets is None else offsets[i])
            if p.seed is not None:
                seed = p.seed % 2**64  # two's complement of a negative seed
                seeds[i], seeds_hi[i], has_seed[i] = seed & 0xFFFFFFFF, seed >> 32, True
            bias = dict(p.logit_bias or {})
            if out_pos[i] < p.min_tokens:  # EOS and stop tokens may not end it yet
                eos = ib.eos_token_ids[row]
                for tok in [*([eos] if eos is not None else []), *(p.stop_token_ids or [])]:
                    bias[tok] = -np.inf
            bias_ids[i, : len(bias)] = list(bias)
            bias_vals[i, : len(bias)] = list(bias.values())
        md = SamplingMetadata(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            presence_penalty=presence, frequency_penalty=frequency,
            repetition_penalty=repetition, prompt_mask=None, output_counts=None,  # step fills
            bias_token_ids=bias_ids, bias_values=bias_vals, seeds=seeds, seeds_hi=seeds_hi,
            has_seed=has_seed,
            output_positions=out_pos, token_bitmask=self._free_bitmask(s),
        )  # fmt: skip
        return md, bool((bias_ids >= 0).any())


class ForwardInputs(NamedTuple):
    """The forward's host-built inputs: T tokens (padded) of up to min(T, R) sequences."""

    input_ids: np.ndarray  # i32[T]; -1: take the row's last sampled token on the device
    positions: np.ndarray  # i32[T]
    token_rows: np.ndarray  # i32[T]: each token's input-batch row
    attn: AttentionMetadata
    logits_indices: np.ndarray  # i32[R]: each sequence's last token in the flat batch


class SampleInputs(NamedTuple):
    """The sampling step's host-built inputs: S sequences (padded with greedy rows)."""

    sampling: SamplingMetadata  # [S] rows; prompt_mask / output_counts None (from the device)
    rows: np.ndarray  # i32[S]: each sequence's input-batch row (its penalty state)
    appends: np.ndarray  # bool[S]: the sampled token is kept (SchedulerOutput.sampled_req_ids)
    want_logprobs: np.ndarray  # bool[]: some sequence asked for sampled-token logprobs
    step: np.ndarray  # i32[]: the step counter, folded into the PRNG key
    # i32[S, k]: the drafts before each row's position (-1: none), which penalties count as
    # output (speculative decoding; k = 0 without it)
    prior_drafts: np.ndarray


class PendingStep(NamedTuple):
    """A dispatched step: its device outputs and what fetch() needs to unpack them."""

    req_ids: list[str]
    rows: np.ndarray  # i32[num_reqs]
    appends: np.ndarray  # bool[num_reqs]: the sampled token is kept as a placeholder (no drafts)
    append_positions: np.ndarray  # i32[num appended]: where each kept token goes
    qsl: np.ndarray  # i32[S+1]
    start: np.ndarray  # i32[num_reqs]: first position run this step
    targets: np.ndarray  # i32[T]: prompt-logprob targets
    wants_prompt_lp: np.ndarray  # bool[num_reqs]
    fetch: dict | None  # device arrays to bring back; None until the sampling is dispatched
    deferred: _DeferredSample | None = None  # the sampling, until dispatched
    pooled: tuple | None = None  # a pooling runner's (sums, firsts, lasts) on the device
    sampled: np.ndarray | None = None  # bool[num_reqs]: the step samples the next token
    first_row: np.ndarray | None = None  # i32[num_reqs]: each request's first sampling row
    drafts: list[list[int]] | None = None  # each request's draft tokens (one row each)
    # A KV connector's saves: (block hashes, [(device blocks [n, 2, L, bs, H, hd], real n)])
    kv_saves: tuple[list, list[tuple[jax.Array, int]]] | None = None


class _DeferredSample(NamedTuple):
    """What a step's sampling needs once its forward is dispatched."""

    needed: SamplerVariant  # the passes the batch needs (structured added with a bitmask)
    sample_inputs: SampleInputs
    last_hidden: jax.Array  # [R, D]
    hidden: jax.Array  # [T, D]
    num_tokens: int  # T, the token bucket


def _pool_fn(hidden, seq_of_token, first, last, *, num_seqs: int):
    """hidden [T, D]; seq_of_token i32[T] (num_seqs: padding); first, last i32[S]: each
    sequence's first and last token in the step -> f32 (sum over its tokens, first token's,
    last token's hidden state), each [S, D]."""
    h = hidden.astype(jnp.float32)
    sums = jax.ops.segment_sum(h, seq_of_token, num_segments=num_seqs + 1)[:num_seqs]
    return sums, h[first], h[last]


def _penalised(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty) or (
        params.repetition_penalty != 1.0
    )


def _init_penalty_row(penalty_state, row, token_ids, num_prompt, num_tokens):
    """Fill one row's penalty state from its tokens: i32[max_model_len], the first num_prompt
    the prompt, up to num_tokens its output so far (a request resumed after preemption)."""
    prompt_mask, output_counts = penalty_state
    vocab = prompt_mask.shape[1]
    idx = jnp.arange(token_ids.shape[0])
    in_prompt = jnp.where(idx < num_prompt, token_ids, vocab)  # vocab: dropped
    in_output = jnp.where((idx >= num_prompt) & (idx < num_tokens), token_ids, vocab)
    mask = jnp.zeros(vocab, bool).at[in_prompt].set(True, mode="drop")
    counts = jnp.zeros(vocab, jnp.int32).at[in_output].add(1, mode="drop")
    return prompt_mask.at[row].set(mask), output_counts.at[row].set(counts)
