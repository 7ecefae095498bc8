"""Pipeline parallelism's model runner (`--pipeline-parallel-size`): the decoder layers split
into stages (config/pipeline.py), each stage a program of its own on its own devices.

  stage s     its layers' weights and KV cache on its tp-device mesh (`meshes[s]`); the
              first stage embeds the tokens, the last one applies the final norm and holds
              the LM head (a copy of a tied embedding), the sampler and its state
  a step      each stage's forward executable in turn, the hidden states [T, D] handed to the
              next stage's devices with `jax.device_put`; then the sampling, as ModelRunner

Every call is asynchronous: while micro-batch n runs on stage 2's devices, the engine core
(engine/core.py's batch queue) dispatches micro-batch n + 1 to stage 1's, so the stages work
at once. This is MPMD, a program per stage, rather than one SPMD program with a pipeline
axis: that would need every stage's layers stacked with one structure, and the model families
loop over layers of several kinds in Python (Gemma 3's sliding and global layers, DeepSeek's
dense then MoE layers).

The block manager is shared: block b of every stage's cache holds the same tokens, of that
stage's layers. What pp > 1 runs with is config/compat.py's table (docs/features.md):
speculative decoding, LoRA, images, pooling and KV connectors, among others, are refused.

Over several hosts (`--nnodes`, distributed/mesh.py::pipeline_meshes) every rank makes every
runner call (worker/multihost.py) but runs only the programs of the stages on its devices; a
hand-off between stages on different processes is a collective program of both stages'
processes (distributed/stage_transfer.py). The last stage, which samples, is on rank 0's
devices; the other ranks learn each step's sampled tokens from rank 0 (`fetch(sampled=)`), for
their input batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, compat
from jaxserve.core.scheduler_output import ModelRunnerOutput
from jaxserve.distributed.stage_transfer import (
    StageLink,
    crosses_processes,
    is_local,
    mesh_processes,
)
from jaxserve.layers.attention import configure_attention
from jaxserve.layers.fused_moe import configure_moe
from jaxserve.models.loader import LoadedModel
from jaxserve.worker import executable_cache
from jaxserve.worker.executables import ExecutableRegistry
from jaxserve.worker.kv_cache import KVCacheSpec, determine_num_blocks
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.step_functions import ModelDef
from jaxserve.worker.step_types import PendingStep


def stage_forward(model_def: ModelDef, params, kv_caches, hidden_in, inputs, *, last: bool):
    """One stage's layers over T tokens: the first stage (hidden_in None) embeds the tokens.
    Returns (hidden [T, D], kv_caches), or on the last stage (hidden of each sampling row
    [R, D], hidden [T, D], kv_caches) after the final norm."""
    model = model_def.merge(params)
    hidden, kv_caches = model(inputs._replace(hidden_in=hidden_in), kv_caches, final_norm=last)
    if last:
        return hidden[inputs.logits_indices], hidden, kv_caches
    return hidden, kv_caches


def stage_model(full: nnx.Module, layers: range, first: bool, last: bool) -> nnx.Module:
    """A copy of `full` (sharing its arrays) with only `layers`, the embedding on the first
    stage and the final norm on the last; the LM head is the runner's own array."""
    model = nnx.merge(*nnx.split(full))
    model.layers = nnx.List([model.layers[i] for i in layers])
    if not first:
        model.embed_tokens = None
    if not last:
        model.norm = None
    if getattr(model, "lm_head", None) is not None:
        model.lm_head = None
    return model


class PipelineRunner(ModelRunner):
    def __init__(
        self,
        loaded: LoadedModel,
        engine_config: EngineConfig,
        stages: list[range],
        meshes: list[Mesh],
        *,
        executables: ExecutableRegistry | None = None,
    ):
        """loaded: the model with each parameter on its stage's mesh (load_model's mesh_of);
        stages: each stage's layers; meshes: each stage's devices."""
        self.stages, self.meshes = stages, meshes
        last = len(stages) - 1
        self.local = [is_local(m) for m in meshes]  # the stages this process runs
        self.samples = self.local[-1]  # this process samples (and reads the sampled tokens)
        # whether a rank without the last stage needs rank 0's sampled tokens (multihost.py)
        self.followers_need_sampled = len(mesh_processes(meshes[-1])) < jax.process_count()
        models = [stage_model(loaded.model, r, s == 0, s == last) for s, r in enumerate(stages)]
        # The sampler, the LM head and the step state live on the last stage's devices.
        super().__init__(
            dataclasses.replace(loaded, mesh=meshes[-1]), engine_config, executables=executables
        )
        # Into stage s: None, a device_put within this process, or a link across processes.
        self.links = [None] + [
            StageLink(a, b) if crosses_processes(a, b) else None
            for a, b in zip(meshes, meshes[1:], strict=False)
        ]
        self.head = self._head_on_last_stage(self.head)
        cc = engine_config.cache
        backend = engine_config.attention_backend
        self.kv_specs, self.stage_defs, self.stage_params, self.stage_jits = [], [], [], []
        for s, (model, mesh) in enumerate(zip(models, meshes, strict=True)):
            configure_attention(model, backend, mesh)
            configure_moe(model, mesh)
            spec = KVCacheSpec(
                dataclasses.replace(self.config, num_layers=len(stages[s])),
                mesh,
                cc.block_size,
                cc.kv_dtype(self.config.dtype),
                loaded.model.num_cache_kv_heads,
                self.max_num_seqs,
            )
            graphdef, state = nnx.split(model)
            params, params_def = jax.tree.flatten(state)
            model_def = ModelDef(graphdef, params_def)
            rep = NamedSharding(mesh, P())
            outs = (rep, rep, spec.sharding) if s == last else (rep, spec.sharding)
            jitted = jax.jit(
                functools.partial(stage_forward, model_def, last=s == last),
                donate_argnums=(1,),
                out_shardings=outs,
            )
            self.kv_specs.append(spec)
            self.stage_defs.append(model_def)
            self.stage_params.append(params)
            self.stage_jits.append(jitted)
        self.stage_rep = [NamedSharding(m, P()) for m in meshes]

    def _head_on_last_stage(self, head: jax.Array) -> jax.Array:
        """The LM head on the last stage's devices (a tied embedding is the first stage's):
        copied, across processes by a one-off link program."""
        src, spec = head.sharding.mesh, head.sharding.spec
        if list(src.devices.flat) == list(self.meshes[-1].devices.flat):
            return head
        if not crosses_processes(src, self.meshes[-1]):
            return jax.device_put(head, NamedSharding(self.meshes[-1], spec))
        link = StageLink(src, self.meshes[-1])
        if not link.involved:
            return head
        moved = link.move(head if is_local(src) else None, head.shape, head.dtype, spec)
        return head if moved is None else moved

    # ------------------------------------------------------------------ start-up
    def kv_bytes_per_block(self) -> int:
        """The most one device holds of a block: its stage's layers."""
        return max(spec.bytes_per_block() for spec in self.kv_specs)

    def determine_num_blocks(self) -> int:
        """The fewest blocks that fit on a stage of this process (ModelRunner's budget rule on
        each stage's devices: the first stage holds the embedding, the last the LM head)."""
        sizes = (self.kv_bytes_per_block(), self.max_blocks_per_req + 1, self.max_model_len)
        return min(
            determine_num_blocks(self.engine_config.cache, mesh.local_devices[0], *sizes)
            for mesh, local in zip(self.meshes, self.local, strict=True)
            if local
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [
            spec.allocate(num_blocks) if local else None
            for spec, local in zip(self.kv_specs, self.local, strict=True)
        ]
        self.num_blocks = num_blocks

    def lowerings(self) -> dict[tuple, Any]:
        """ModelRunner's (where this process samples), with one forward per stage of this
        process for every forward shape, and the hand-offs across processes it takes part in."""
        out = {}
        if self.samples:
            out = {n: f for n, f in super().lowerings().items() if n[0] != "forward"}
        d, dtype = self.config.hidden_size, self.config.dtype
        for t, decode_only in self.forward_variants():
            inputs = self._padding(t, decode_only, spec=True)
            for s, jitted in enumerate(self.stage_jits):
                if not self.local[s]:
                    continue
                kv = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                    self.kv_caches[s],
                )
                rep = self.stage_rep[s]
                h = None if s == 0 else jax.ShapeDtypeStruct((t, d), dtype, sharding=rep)
                out["forward", t, decode_only, s] = functools.partial(
                    jitted.lower, self.stage_params[s], kv, h, inputs
                )
        for s, link in enumerate(self.links):
            if link is not None and link.involved:
                program = link.program(P())
                for t in self.buckets.tokens:
                    out["handoff", t, s] = functools.partial(
                        program.lower, link.union_shape((t, d), dtype, P())
                    )
        return out

    def devices_of(self, name: tuple) -> list:
        """The devices step shape `name` runs on: its stage's, a hand-off's two stages'."""
        if name[0] == "forward":
            return list(self.meshes[name[3]].devices.flat)
        if name[0] == "handoff":
            return list(self.links[name[2]].union.devices.flat)
        return super().devices_of(name)

    def executables_key(self) -> str:
        """ModelRunner's, with the stages' devices and this process (whose stages it runs)."""
        return executable_cache.signature(
            runner=super().executables_key(),
            stages=repr(self.meshes),
            process=jax.process_index(),
        )

    def dummy_step(self) -> None:
        raise RuntimeError(compat.reason("pipeline parallel", "data parallel"))

    # ------------------------------------------------------------------ a serving step
    def _forward(self, batch) -> tuple:
        """This process's stages' forwards in turn, each stage's output handed to the next
        one's devices (all asynchronous); (last_hidden, hidden) of the last stage, or
        (None, None) where this process does not run it."""
        t = batch.num_tokens
        name = (t, batch.forward.attn.decode_only)
        shape, dtype, last = (t, self.config.hidden_size), self.config.dtype, len(self.stages) - 1
        hidden = None
        for s in range(len(self.stages)):
            link = self.links[s]
            if link is not None:  # a collective of both stages' processes
                if link.involved:
                    hidden = link.move(hidden, shape, dtype, P(), self.executables["handoff", t, s])
            elif hidden is not None:
                hidden = jax.device_put(hidden, self.stage_rep[s])
            if not self.local[s]:
                hidden = None
                continue
            outs = self.executables["forward", *name, s](
                self.stage_params[s], self.kv_caches[s], hidden, batch.forward
            )
            self.kv_caches[s] = outs[-1]
            hidden = outs[0] if s < last else outs[:2]
        return hidden if self.samples else (None, None)

    def dispatch_sample(self, pending: PendingStep, bitmask: np.ndarray | None) -> PendingStep:
        """ModelRunner's, where this process holds the last stage (else nothing to sample)."""
        return super().dispatch_sample(pending, bitmask) if self.samples else pending

    def fetch(
        self, pending: PendingStep, sampled: np.ndarray | None = None
    ) -> ModelRunnerOutput | None:
        """ModelRunner's where this process samples; elsewhere the input batch takes the
        step's sampled tokens from rank 0 (`sampled`: i32[num_reqs], BroadcastRunner's)."""
        if self.samples:
            return super().fetch(pending)
        self.input_batch.fill_sampled(pending.batch, sampled)
        return None

    def _fill_penalty_row(self, row: int) -> None:
        if self.samples:  # the penalty state is the sampler's, on the last stage
            super()._fill_penalty_row(row)
