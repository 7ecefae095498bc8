"""Pipeline parallelism (`--pipeline-parallel-size`): the model runner's Stages (stages.py) as
the decoder layers split into stages (config/pipeline.py), each stage a program of its own on
its own devices (a StageExecutor each).

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
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, compat
from jaxserve.distributed.stage_transfer import (
    StageLink,
    crosses_processes,
    is_local,
    mesh_processes,
)
from jaxserve.layers.attention import configure_attention
from jaxserve.layers.fused_moe import configure_moe
from jaxserve.models.loader import LoadedModel
from jaxserve.worker.kv_cache import KVCacheSpec, determine_num_blocks
from jaxserve.worker.stages import shapes
from jaxserve.worker.step_functions import ModelDef


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


class StageExecutor:
    """One stage: its layers' program, parameters and KV cache spec on its mesh."""

    def __init__(self, model: nnx.Module, mesh: Mesh, spec: KVCacheSpec, *, last: bool):
        graphdef, state = nnx.split(model)
        self.params, params_def = jax.tree.flatten(state)
        self.model_def = ModelDef(graphdef, params_def)
        self.mesh, self.spec, self.last = mesh, spec, last
        self.local = is_local(mesh)  # this process runs it
        self.rep = NamedSharding(mesh, P())
        outs = (self.rep, self.rep, spec.sharding) if last else (self.rep, spec.sharding)
        self.jitted = jax.jit(
            functools.partial(stage_forward, self.model_def, last=last),
            donate_argnums=(1,),
            out_shardings=outs,
        )

    def lowering(self, kv, t: int, hidden_size: int, dtype, inputs, first: bool):
        """The stage's forward over bucket t (kv: its cache's shapes)."""
        h = None if first else jax.ShapeDtypeStruct((t, hidden_size), dtype, sharding=self.rep)
        return functools.partial(self.jitted.lower, self.params, kv, h, inputs)


class PipelineStages:
    """The decoder layers as stage programs, each on its own devices (the runner's Stages)."""

    def __init__(
        self,
        loaded: LoadedModel,
        engine_config: EngineConfig,
        stages: list[range],
        meshes: list[Mesh],
    ):
        """loaded: the model with each parameter on its stage's mesh (load_model's mesh_of);
        stages: each stage's layers; meshes: each stage's devices."""
        self.layers, self.meshes = stages, meshes
        last = len(stages) - 1
        self.samples = is_local(meshes[-1])  # this process samples (and reads the tokens)
        # whether a rank without the last stage needs rank 0's sampled tokens (multihost.py)
        self.followers_need_sampled = len(mesh_processes(meshes[-1])) < jax.process_count()
        # Into stage s: None, a device_put within this process, or a link across processes.
        self.links = [None] + [
            StageLink(a, b) if crosses_processes(a, b) else None
            for a, b in zip(meshes, meshes[1:], strict=False)
        ]
        cc, config = engine_config.cache, loaded.config
        self.stages: list[StageExecutor] = []
        for s, (layers, mesh) in enumerate(zip(stages, meshes, strict=True)):
            model = stage_model(loaded.model, layers, s == 0, s == last)
            configure_attention(model, engine_config.attention_backend, mesh)
            configure_moe(model, mesh)
            spec = KVCacheSpec(
                dataclasses.replace(config, num_layers=len(layers)),
                mesh,
                cc.block_size,
                cc.kv_dtype(config.dtype),
                loaded.model.num_cache_kv_heads,
                engine_config.scheduler.max_num_seqs,
            )
            self.stages.append(StageExecutor(model, mesh, spec, last=s == last))

    def place_head(self, head: jax.Array) -> jax.Array:
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
    def kv_bytes_per_block(self, runner) -> int:
        """The most one device holds of a block: its stage's layers."""
        return max(stage.spec.bytes_per_block() for stage in self.stages)

    def determine_num_blocks(self, runner) -> int:
        """The fewest blocks that fit on a stage of this process (one stage's budget rule on
        each stage's devices: the first stage holds the embedding, the last the LM head)."""
        sizes = (runner.kv_bytes_per_block(), runner.max_blocks_per_req + 1, runner.max_model_len)
        cache = runner.engine_config.cache
        return min(
            determine_num_blocks(cache, stage.mesh.local_devices[0], *sizes)
            for stage in self.stages
            if stage.local
        )

    def allocate(self, runner, num_blocks: int) -> list:
        """Each stage's KV cache (None for a stage of another process)."""
        return [stage.spec.allocate(num_blocks) if stage.local else None for stage in self.stages]

    def lowerings(self, runner, padding: dict) -> dict[tuple, Any]:
        """One forward per stage of this process for every forward shape, and the hand-offs
        across processes it takes part in."""
        out, d, dtype = {}, runner.config.hidden_size, runner.config.dtype
        for (t, decode_only), inputs in padding.items():
            for s, stage in enumerate(self.stages):
                if stage.local:
                    kv = shapes(runner.kv_caches[s])
                    out["forward", t, decode_only, s] = stage.lowering(
                        kv, t, d, dtype, inputs, first=s == 0
                    )
        for s, link in enumerate(self.links):
            if link is not None and link.involved:
                program = link.program(P())
                for t in runner.buckets.tokens:
                    out["handoff", t, s] = functools.partial(
                        program.lower, link.union_shape((t, d), dtype, P())
                    )
        return out

    def devices_of(self, runner, name: tuple) -> list:
        """The devices step shape `name` runs on: its stage's, a hand-off's two stages'."""
        if name[0] == "forward":
            return list(self.meshes[name[3]].devices.flat)
        if name[0] == "handoff":
            return list(self.links[name[2]].union.devices.flat)
        return list(runner.mesh.devices.flat)

    def cache_key(self) -> dict[str, str]:
        """The stages' devices and this process (whose stages it runs)."""
        return {"stages": repr(self.meshes), "process": str(jax.process_index())}

    def dummy_step(self, runner) -> None:
        raise RuntimeError(compat.reason("pipeline parallel", "data parallel"))

    # ------------------------------------------------------------------ a serving step
    def forward(self, runner, batch) -> tuple:
        """This process's stages' forwards in turn, each stage's output handed to the next
        one's devices (all asynchronous); (last_hidden, hidden) of the last stage, or
        (None, None) where this process does not run it."""
        t = batch.num_tokens
        name = (t, batch.forward.attn.decode_only)
        shape, dtype = (t, runner.config.hidden_size), runner.config.dtype
        hidden, executables = None, runner.executables
        for s, stage in enumerate(self.stages):
            link = self.links[s]
            if link is not None:  # a collective of both stages' processes
                if link.involved:
                    hidden = link.move(hidden, shape, dtype, P(), executables["handoff", t, s])
            elif hidden is not None:
                hidden = jax.device_put(hidden, stage.rep)
            if not stage.local:
                hidden = None
                continue
            outs = executables["forward", *name, s](
                stage.params, runner.kv_caches[s], hidden, batch.forward
            )
            runner.kv_caches[s] = outs[-1]
            hidden = outs[:2] if stage.last else outs[0]
        return hidden if self.samples else (None, None)
