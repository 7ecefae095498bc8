"""Lifecycle step 7, running one compiled step: the model runner wires the step's parts.

  dispatch        the scheduler's changes into the input batch (input_batch.py), the step's
                  inputs (batch_builder.py), a KV connector's loads, the forward executable,
                  a proposer's mirror, the pooler; then the sampling unless it waits for
                  grammar bitmasks (dispatch_sample)
  fetch           the step's one host sync: sampled ids (and logprobs when asked) back,
                  drafts accepted and the next ones proposed (spec_decode/), prompt logprobs
                  and pooled vectors unpacked into a ModelRunnerOutput
  start-up        KV cache sizing (kv_cache.py), then every step shape compiled or loaded
                  (step_compiler.py, executables.py) from the pure step functions
                  (step_functions.py) at the buckets (buckets.py): serving calls only these
                  executables

Between a step's dispatch and its fetch the engine core schedules and dispatches the next
step: a token still being sampled (and a draft still being proposed) is a placeholder the
forward reads from the device (`step_state`, worker/step_state.py).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve import envs
from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.distributed.sharding import put
from jaxserve.layers.attention import configure_attention
from jaxserve.layers.fused_moe import configure_moe
from jaxserve.layers.sampler import pick_variant
from jaxserve.models.loader import LoadedModel
from jaxserve.worker import fused_sampling, step_functions
from jaxserve.worker.batch_builder import BatchBuilder, prompt_logprobs_of
from jaxserve.worker.buckets import BucketTable
from jaxserve.worker.device_state import DeviceState
from jaxserve.worker.executables import ExecutableRegistry
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.kv_block_io import KVBlockCopier
from jaxserve.worker.kv_cache import KVCacheSpec
from jaxserve.worker.runner_protocol import EncoderCacheSpec, KVLayout
from jaxserve.worker.spec_decode.drafting import Drafting
from jaxserve.worker.spec_decode.proposer import Proposer
from jaxserve.worker.stages import OneStage, Stages
from jaxserve.worker.step_compiler import StepCompiler
from jaxserve.worker.step_features import build_features
from jaxserve.worker.step_state import num_columns
from jaxserve.worker.step_types import PendingStep

logger = logging.getLogger(__name__)

# Per attention backend: whether a decode-only step (one new token a request, no drafts) runs
# a forward of its own, the decode path alone (the Pallas kernel: else a lax.cond compiles both
# kernels into every step). The reference's was no faster on CPU (0.96-1.01x the general
# forward's; benchmarks/results/cpu.md), nor is the CPU kernel's: one forward per bucket.
DECODE_ONLY_FORWARDS = {"pallas": True, "cpu": False, "reference": False}


class ModelRunner(StepCompiler):
    """One process's devices running the step (the Runner protocol: runner_protocol.py)."""

    def __init__(
        self,
        loaded: LoadedModel,
        engine_config: EngineConfig,
        proposer: Proposer | None = None,
        *,
        executables: ExecutableRegistry | None = None,
        stages: Stages | None = None,
    ):
        """proposer: what drafts tokens (speculative decoding; worker/build.py makes it);
        executables: the registry to compile into (worker/executables.py; a test's may wrap
        how shapes compile or are looked up), a new one by default; stages: where the
        forward runs (stages.py), the whole model on `loaded.mesh` by default."""
        sc, cc = engine_config.scheduler, engine_config.cache
        self.engine_config = engine_config
        self.config = loaded.config
        self.mesh = loaded.mesh
        self.max_model_len = sc.max_model_len
        self.max_blocks_per_req = -(-self.max_model_len // cc.block_size)
        self.max_num_seqs = sc.max_num_seqs
        self.proposer = proposer or Proposer()
        self.stages = stages or OneStage()
        # A process without the last stage (a pipeline over hosts) neither samples nor holds
        # the step state: its input batch takes each step's tokens from rank 0 (fetch).
        self.samples = self.stages.samples
        self.followers_need_sampled = self.stages.followers_need_sampled
        k = self.proposer.num_speculative_tokens
        self.buckets = BucketTable.build(
            sc.max_num_seqs, sc.max_num_batched_tokens, k, coarse=envs.JAXSERVE_MINIMAL_COMPILE
        )
        self.decode_only_forwards = DECODE_ONLY_FORWARDS[engine_config.attention_backend]
        self.drafting = Drafting(self.proposer, self.max_model_len)
        layout = cc.grouped_layout
        self.input_batch = InputBatch(
            self.max_num_seqs,
            self.max_model_len,
            self.max_blocks_per_req,
            layout.num_groups if layout else 1,
        )
        self.builder = BatchBuilder(
            self.buckets,
            block_size=cc.block_size,
            max_model_len=self.max_model_len,
            max_blocks_per_req=self.max_blocks_per_req,
            vocab_size=self.config.vocab_size,
            num_spec_tokens=k,
            decode_only_forwards=self.decode_only_forwards,
            kv_layout=layout,
        )
        configure_attention(loaded.model, engine_config.attention_backend, self.mesh)
        configure_moe(loaded.model, self.mesh)
        self.kv = KVCacheSpec(
            self.config,
            self.mesh,
            cc.block_size,
            cc.kv_dtype(self.config.dtype),
            loaded.model.num_cache_kv_heads,
            self.max_num_seqs + cc.state_cache_slots,  # a hybrid model's state rows, kept ones
            layout,
            self.config.v_slots if layout is None else None,  # (GLM-5: fewer V slots)
        )
        self.head = self.stages.place_head(loaded.model.logits_head)  # [V, D] tied or [D, V]
        rep = self._replicated = NamedSharding(self.mesh, P())
        # LoRA, images, pooling, KV transfer (worker/step_feature.py): built before the split
        self.features = build_features(loaded, engine_config, self.kv, rep)
        graphdef, state = nnx.split(loaded.model)
        self.params, params_def = jax.tree.flatten(state)
        for feature in self.features:
            feature.attach(state)
        self.model_def = step_functions.ModelDef(graphdef, params_def, self.proposer.aux_layers)
        self.kv_caches: tuple[jax.Array, ...] | None = None  # K, V (+ a hybrid's states)
        self.num_blocks = 0
        self.step_count = 0
        self.executables = executables if executables is not None else ExecutableRegistry()
        self.minimal_compile = envs.JAXSERVE_MINIMAL_COMPILE
        self.fused = None  # a decode step's forward and sampling as one executable
        if self.samples and fused_sampling.enabled(
            engine_config.attention_backend,
            one_stage=isinstance(self.stages, OneStage),
            drafts=bool(k or self.proposer.aux_layers),
            minimal=self.minimal_compile,
        ):
            shapes = fused_sampling.decode_shapes(self.buckets, self.forward_variants())
            self.fused = fused_sampling.FusedSampling(shapes)
        self.proposer.set_executables(self.executables)
        head_def = step_functions.HeadDef(
            self.config.tie_word_embeddings, self.config.final_logit_softcapping
        )
        self._jits = step_functions.jit_steps(
            self.model_def,
            head_def,
            jax.random.PRNGKey(engine_config.seed),
            engine_config.max_logprobs,
            self.kv.sharding,
            rep,
            cc.block_size,
        )
        # Penalty state per input-batch row, on the device: (prompt_mask bool[N, V],
        # output_counts i32[N, V]). A penalised request's row is filled once when it is
        # scheduled (init_penalty_row); each step with penalties then adds its kept tokens.
        r, v = self.max_num_seqs, self.config.vocab_size
        self.penalty_state = put((np.zeros((r, v), bool), np.zeros((r, v), np.int32)), rep)
        self.step_state = put(np.zeros((r, num_columns(k)), np.int32), rep)  # i32[N, k + 3]

    @property
    def model(self) -> nnx.Module:
        """The model as the steps see it (its parameters are the runner's arrays)."""
        return self.model_def.merge(self.params)

    # ------------------------------------------------------------------ start-up
    def kv_bytes_per_block(self) -> int:
        """Every cache one block id covers: the target's and a proposer's."""
        block_size = self.kv.block_size
        return self.stages.kv_bytes_per_block(self) + self.proposer.kv_bytes_per_block(block_size)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the budget (per device: this process's), after weights and compiled
        steps."""
        return self.stages.determine_num_blocks(self)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.stages.allocate(self, num_blocks)
        self.num_blocks = num_blocks
        self.proposer.initialize_kv_cache(num_blocks, self.kv.block_size)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB, %s); maximum concurrency at "
            "max_model_len=%d: %.2fx",
            num_blocks,
            self.kv.block_size,
            num_blocks * self.kv_bytes_per_block() / 2**20,
            jnp.dtype(self.kv.dtype).name,
            self.max_model_len,
            num_blocks * self.kv.block_size / self.max_model_len,
        )

    def compile_status(self) -> tuple[int, int]:
        missing = len(self.executables.missing())
        return len(self.executables.names()), len(self.executables.names()) + missing

    # ------------------------------------------------------------------ features
    def kv_layout(self) -> KVLayout:
        return KVLayout(tuple(self.kv.block_shape), np.dtype(self.kv.dtype))

    def set_kv_connector(self, connector) -> None:
        """Load and save KV blocks for `connector` (distributed/kv_transfer) in every step."""
        copier = self.features.get(KVBlockCopier)
        if copier is None:
            raise RuntimeError("a KV connector needs EngineConfig.kv_transfer at start-up")
        copier.connector = connector

    def add_lora(self, request, live) -> None:
        self.features.lora().add_adapter(request, live)

    def remove_lora(self, lora_int_id: int, live: set[int]) -> None:
        self.features.remove_lora(lora_int_id, live)

    def encoder_cache_spec(self) -> EncoderCacheSpec | None:
        return self.features.encoder_cache_spec()

    def check_images(self, features: list) -> None:
        self.features.check_images(features, self.engine_config.model.architecture)

    def device_state(self) -> DeviceState:
        """Sleep, wake and weight updates of this runner's arrays."""
        return DeviceState(self)

    def dummy_step(self) -> None:
        """The smallest forward over padding (no KV written, nothing sampled), run to its
        end: a data-parallel engine with no work steps with the others (vLLM's dummy batch)."""
        self.stages.dummy_step(self)

    # ------------------------------------------------------------------ a serving step
    def dispatch(self, so: SchedulerOutput) -> PendingStep | None:
        """Apply the scheduler's changes to the input batch and start the step on the devices
        (asynchronously); None when nothing was scheduled."""
        ib, executables, features = self.input_batch, self.executables, self.features
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            for feature in features:
                feature.forget(req_id)
            self.drafting.forget(req_id)
        for row in ib.update(so):
            self._fill_penalty_row(row)
        for feature in features:  # e.g. images into the encoder cache, adapters into slots
            feature.prepare(so, ib, self.params, executables)
        batch = self.builder.build(so, ib, self.ready_token_buckets(), self.step_count)
        if batch is None:
            return None
        forward = batch.forward
        for feature in features:
            forward = feature.forward_inputs(forward, batch, ib)
            self.kv_caches = feature.load(so, self.kv_caches, executables)
        batch = batch._replace(forward=forward)
        waits = bool(so.structured_output_req_ids) or ib.sampling.has_bad_words[batch.rows].any()
        fused = self.fused and self.fused.pick(batch, waits, executables)
        if fused:  # forward and sampling in one executable
            args = (self.params, self.kv_caches, self.step_state, batch.forward, self.head)
            outs = executables[fused](*args, self.penalty_state, batch.sample)
            hidden, self.kv_caches, out, self.penalty_state, self.step_state, settled = outs
            last_hidden, aux = None, []
        else:
            last_hidden, hidden, *aux = self.stages.forward(self, batch)
        values = {}
        for feature in features:  # e.g. pooled states, KV blocks to save
            value = feature.after_forward(so, batch, hidden, self.kv_caches, executables)
            if value is not None:
                values[feature.name] = value
        self.step_count += 1
        pending = PendingStep(batch, None, last_hidden, hidden, values)
        if fused:
            return self._sampled(pending, out, settled)
        # The proposer follows the forward (EAGLE-3: from the features the forward returned).
        aux, aux_rows = aux if self.model_def.aux_layers else (hidden, last_hidden)
        self.proposer.mirror(batch, aux, aux_rows, self.step_state)
        if waits:
            return pending  # sampled once every earlier token is known (grammars, bad words)
        return self.dispatch_sample(pending, None)

    def dispatch_sample(self, pending: PendingStep, bitmask: np.ndarray | None) -> PendingStep:
        """Start a dispatched step's sampling; bitmask: i32[num_reqs, ceil(V/32)] (or None),
        the allowed tokens of each row (structured outputs)."""
        if not self.samples:
            return pending
        batch, ib = pending.batch, self.input_batch
        sample_inputs, needed = batch.sample, batch.needed
        s = sample_inputs.rows.shape[0]
        if bitmask is not None or ib.sampling.has_bad_words[batch.rows].any():
            bitmask = ib.sampling.blocked_bitmask(
                sample_inputs.sampling,
                sample_inputs.rows,
                int(batch.num_rows.sum()),
                bitmask,
                ib.token_ids,
                ib.num_prompt_tokens,
            )
        if bitmask is not None:
            sample_inputs = sample_inputs._replace(
                sampling=sample_inputs.sampling._replace(token_bitmask=bitmask)
            )
            needed = needed._replace(structured=True)
        variant = pick_variant(needed, ready=lambda v: ("sample", s, v) in self.executables)
        out, self.penalty_state, self.step_state, settled = self.executables["sample", s, variant](
            self.head, pending.last_hidden, self.penalty_state, self.step_state, sample_inputs
        )
        return self._sampled(pending, out, settled)

    def _sampled(self, pending: PendingStep, out, settled) -> PendingStep:
        """A step whose sampling is dispatched: its proposals, and its results on their way
        to the host."""
        batch, ib, needed = pending.batch, self.input_batch, pending.batch.needed
        # A device proposer drafts now, before the next step may read its drafts.
        self.step_state, drafts = self.proposer.propose(self.step_state, batch, settled, ib)
        fetch = {"ids": out.token_ids, "accepted": settled.accepted, "features": pending.features}
        if drafts is not None:
            fetch["drafts"] = drafts
        if needed.logprobs:
            fetch["logprobs"] = (out.logprobs, out.logprob_token_ids, out.sampled_rank)
        if batch.wants_prompt_lp.any():
            fetch["prompt_logprobs"] = self.executables["prompt_logprobs", batch.num_tokens](
                self.head, pending.hidden, batch.targets
            )
        for leaf in jax.tree.leaves(fetch):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
        return pending._replace(fetch=fetch, last_hidden=None, hidden=None)

    def fetch(
        self, pending: PendingStep, sampled: np.ndarray | None = None
    ) -> ModelRunnerOutput | None:
        """Wait for a dispatched step and bring its results to the host: the step's one sync.
        Where this process does not sample, the input batch takes the step's tokens from
        rank 0 instead (`sampled`: i32[num_reqs], worker/multihost.py's)."""
        batch, ib = pending.batch, self.input_batch
        if not self.samples:
            row_ids = np.zeros(int(batch.num_rows.sum()), np.int32)
            row_ids[batch.first_row] = sampled
            ib.append_sampled(batch, row_ids, batch.first_row)
            return None
        fetched = jax.device_get(pending.fetch)
        row_ids = np.asarray(fetched["ids"], np.int32)
        final_row, accepted, refill = self.drafting.accept(batch, row_ids, fetched["accepted"], ib)
        ib.append_sampled(batch, row_ids, final_row)
        for row in refill:  # a drafted row's kept tokens were not counted in the step
            self._fill_penalty_row(row)
        result = ModelRunnerOutput(batch.req_ids, row_ids[final_row])  # each one's kept token
        result.accepted_drafts = accepted
        values = fetched["features"]
        for feature in self.features:
            if feature.name in values:
                feature.finish(batch, values[feature.name], ib, result)
        if "prompt_logprobs" in fetched:
            result.prompt_logprobs = prompt_logprobs_of(batch, *fetched["prompt_logprobs"])
        if "logprobs" in fetched:
            lp, lp_ids, ranks = fetched["logprobs"]
            result.logprobs, result.logprob_token_ids, result.sampled_ranks = lp, lp_ids, ranks
            result.first_row = batch.first_row
        result.spec_token_ids = self.drafting.propose(batch, final_row, ib, fetched.get("drafts"))
        return result

    def _fill_penalty_row(self, row: int) -> None:
        """Fill an input-batch row's penalty state from its known tokens (the sampler's)."""
        if not self.samples:
            return
        ib = self.input_batch
        self.penalty_state = self.executables["init_penalty_row",](
            self.penalty_state,
            np.int32(row),
            ib.token_ids[row],
            ib.num_prompt_tokens[row],
            ib.num_tokens[row],
        )
