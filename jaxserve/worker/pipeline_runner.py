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
stage's layers. Speculative decoding, LoRA, images, pooling and KV connectors are refused
with pp > 1 (engine/arg_utils.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.layers.attention import configure_attention
from jaxserve.layers.fused_moe import configure_moe
from jaxserve.models.loader import LoadedModel
from jaxserve.worker.executables import ExecutableRegistry
from jaxserve.worker.kv_cache import KVCacheSpec
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.step_functions import ModelDef


def stage_forward(model_def: ModelDef, params, kv_caches, hidden_in, inputs, *, last: bool):
    """One stage's layers over T tokens: the first stage (hidden_in None) embeds the tokens.
    Returns (hidden [T, D], kv_caches), or on the last stage (hidden of each sampling row
    [R, D], hidden [T, D], kv_caches) after the final norm."""
    model = model_def.merge(params)
    hidden, kv_caches = model(
        inputs.input_ids, inputs.positions, kv_caches, inputs.attn, token_rows=inputs.token_rows,
        hidden_in=hidden_in, final_norm=last,
    )  # fmt: skip
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
        self, loaded: LoadedModel, engine_config: EngineConfig, stages: list[range],
        meshes: list[Mesh], *, executables: ExecutableRegistry | None = None,
    ):  # fmt: skip
        """loaded: the model with each parameter on its stage's mesh (load_model's mesh_of);
        stages: each stage's layers; meshes: each stage's devices."""
        self.stages, self.meshes = stages, meshes
        last = len(stages) - 1
        models = [stage_model(loaded.model, r, s == 0, s == last) for s, r in enumerate(stages)]
        # The sampler, the LM head and the step state live on the last stage's devices.
        super().__init__(dataclasses.replace(loaded, mesh=meshes[-1]), engine_config,
                         executables=executables)  # fmt: skip
        self.head = jax.device_put(self.head, NamedSharding(meshes[-1], self.head.sharding.spec))
        cc = engine_config.cache
        backend = engine_config.attention_backend
        self.kv_specs, self.stage_defs, self.stage_params, self.stage_jits = [], [], [], []
        for s, (model, mesh) in enumerate(zip(models, meshes, strict=True)):
            configure_attention(model, backend, mesh)
            configure_moe(model, mesh)
            spec = KVCacheSpec(
                dataclasses.replace(self.config, num_layers=len(stages[s])), mesh,
                cc.block_size, cc.kv_dtype(self.config.dtype), loaded.model.num_cache_kv_heads,
                self.max_num_seqs,
            )  # fmt: skip
            graphdef, state = nnx.split(model)
            params, params_def = jax.tree.flatten(state)
            model_def = ModelDef(graphdef, params_def)
            rep = NamedSharding(mesh, P())
            outs = (rep, rep, spec.sharding) if s == last else (rep, spec.sharding)
            jitted = jax.jit(
                functools.partial(stage_forward, model_def, last=s == last),
                donate_argnums=(1,), out_shardings=outs,
            )  # fmt: skip
            self.kv_specs.append(spec)
            self.stage_defs.append(model_def)
            self.stage_params.append(params)
            self.stage_jits.append(jitted)
        self.stage_rep = [NamedSharding(m, P()) for m in meshes]

    # ------------------------------------------------------------------ start-up
    def kv_bytes_per_block(self) -> int:
        """The most one device holds of a block: its stage's layers."""
        return max(spec.bytes_per_block() for spec in self.kv_specs)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [spec.allocate(num_blocks) for spec in self.kv_specs]
        self.num_blocks = num_blocks

    def lowerings(self) -> dict[tuple, Any]:
        """ModelRunner's, with one forward per stage for every forward shape."""
        out = {n: f for n, f in super().lowerings().items() if n[0] != "forward"}
        d, dtype = self.config.hidden_size, self.config.dtype
        for t, decode_only in self.forward_variants():
            inputs = self._padding(t, decode_only, spec=True)
            for s, jitted in enumerate(self.stage_jits):
                kv = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                    self.kv_caches[s],
                )
                rep = self.stage_rep[s]
                h = None if s == 0 else jax.ShapeDtypeStruct((t, d), dtype, sharding=rep)
                out["forward", t, decode_only, s] = functools.partial(
                    jitted.lower, self.stage_params[s], kv, h, inputs
                )
        return out

    def dummy_step(self) -> None:
        raise RuntimeError("data parallelism is not supported with pipeline parallelism")

    # ------------------------------------------------------------------ a serving step
    def _forward(self, batch) -> tuple:
        """Every stage's forward in turn, each stage's output moved to the next one's devices
        (all asynchronous); (last_hidden, hidden) of the last stage."""
        name = (batch.num_tokens, batch.forward.attn.decode_only)
        hidden = None
        for s in range(len(self.stages)):
            if hidden is not None:
                hidden = jax.device_put(hidden, self.stage_rep[s])
            outs = self.executables["forward", *name, s](
                self.stage_params[s], self.kv_caches[s], hidden, batch.forward
            )
            self.kv_caches[s] = outs[-1]
            hidden = outs[0] if s < len(self.stages) - 1 else outs[:2]
        return hidden
