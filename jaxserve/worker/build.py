"""Start-up's first steps on the devices: load the weights (and a draft model's), make the
proposer speculative decoding asks for, and build the model runner, without a KV cache. The
engine core calls it (engine/core.py), and so does every multi-host follower rank
(worker/multihost.py)."""

from __future__ import annotations

import dataclasses
import logging

import jax
from flax import nnx

from jaxserve import envs
from jaxserve.config import EngineConfig
from jaxserve.config.pipeline import pp_layer_partition
from jaxserve.config.speculative import mtp_architecture
from jaxserve.distributed.mesh import pipeline_meshes
from jaxserve.distributed.sharding import kv_cache_sharding
from jaxserve.models.loader import LoadedModel, load_model
from jaxserve.startup import StartupTimeline
from jaxserve.worker.buckets import BucketTable
from jaxserve.worker.executables import ExecutableRegistry, enable_persistent_compilation_cache
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.pipeline_stages import PipelineStages
from jaxserve.worker.simulated import SimulatedRunner
from jaxserve.worker.spec_decode.draft_model import DraftModelProposer
from jaxserve.worker.spec_decode.eagle import EagleProposer
from jaxserve.worker.spec_decode.mtp import MtpProposer
from jaxserve.worker.spec_decode.ngram_proposer import NgramProposer
from jaxserve.worker.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)

# The draft architectures of the methods that load a model of their own (mtp: the target's
# MTP head, from the target's checkpoint: config/speculative.py::mtp_architecture).
DRAFT_ARCHITECTURES = {
    "draft_model": None,
    "eagle": "EagleLlamaForCausalLM",
    "eagle3": "Eagle3LlamaForCausalLM",
    "mtp": None,
}


def build_runner(
    config: EngineConfig,
    timeline: StartupTimeline,
    *,
    executables: ExecutableRegistry | None = None,
) -> ModelRunner | SimulatedRunner:
    """The model runner of `config`, its weights placed (executables: the registry it
    compiles into, worker/executables.py; a new one by default). With
    $JAXSERVE_SIMULATED_STEP set, a runner that only simulates a device's step time
    (worker/simulated.py)."""
    if simulated := envs.JAXSERVE_SIMULATED_STEP:
        return SimulatedRunner(config, simulated)
    if config.parallel.pipeline_parallel_size > 1:
        return build_pipeline_runner(config, timeline, executables)
    enable_persistent_compilation_cache()
    with timeline.phase("load weights"):
        loaded = load_model(
            config.model_path,
            dtype=config.model.dtype,
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            load_tokenizer=False,
            load_format=config.load_format,
            # gpt-oss's packed experts alone: "mxfp4" names them (dummy weights, or the format)
            quantization=config.model.quantization or config.model.expert_quant,
            enable_expert_parallel=config.parallel.enable_expert_parallel,
            hf_overrides=config.hf_overrides or None,  # None: hashable (tests cache loads)
        )
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(loaded.model)))
    logger.info(
        "weights: %.1f MiB%s",
        weight_bytes / 2**20,
        f" ({config.model.quantization} linear kernels)" if config.model.quantization else "",
    )
    draft = None
    spec = config.speculative
    if spec is not None and spec.method in DRAFT_ARCHITECTURES:
        with timeline.phase("load draft weights"):
            draft = load_draft(config, loaded)
    with timeline.phase("model runner"):
        proposer = make_proposer(config, loaded, draft)
        return ModelRunner(loaded, config, proposer, executables=executables)


def load_draft(config: EngineConfig, target: LoadedModel) -> LoadedModel:
    """The draft model or head of config.speculative, on the target's mesh; method mtp's
    is the target's own MTP layer, read from its checkpoint as the target is."""
    spec = config.speculative
    if spec.method == "mtp":
        return load_model(
            config.model_path,
            dtype=config.model.dtype,
            mesh=target.mesh,
            load_tokenizer=False,
            load_format=config.load_format,
            quantization=config.model.quantization,
            enable_expert_parallel=config.parallel.enable_expert_parallel,
            architecture=mtp_architecture(target.config),
            hf_overrides=config.hf_overrides or None,
        )
    return load_model(
        spec.model,
        dtype=config.model.dtype,
        mesh=target.mesh,
        load_tokenizer=False,
        architecture=DRAFT_ARCHITECTURES[spec.method],
    )


def build_pipeline_runner(
    config: EngineConfig, timeline: StartupTimeline, executables: ExecutableRegistry | None
) -> ModelRunner:
    """pp stages of tp devices each (distributed/mesh.py::pipeline_meshes: this process's
    first pp * tp, or over several hosts each one's share), every parameter loaded straight
    onto its stage's: a layer's on its stage, the embedding on the first, the final norm and
    LM head on the last (worker/pipeline_stages.py)."""
    pp, tp = config.parallel.pipeline_parallel_size, config.parallel.tensor_parallel_size
    enable_persistent_compilation_cache()
    meshes = pipeline_meshes(tp, pp)
    stages = pp_layer_partition(config.model.num_layers, pp)
    stage_of = {i: s for s, layers in enumerate(stages) for i in layers}

    def mesh_of(path: tuple):
        if path[0] == "layers":
            return meshes[stage_of[int(path[1])]]
        return meshes[-1] if path[0] in ("norm", "lm_head") else meshes[0]

    with timeline.phase("load weights"):
        loaded = load_model(
            config.model_path,
            dtype=config.model.dtype,
            mesh=meshes[0],
            load_tokenizer=False,
            load_format=config.load_format,
            quantization=config.model.quantization,
            hf_overrides=config.hf_overrides or None,
            mesh_of=mesh_of,
        )
    with timeline.phase("model runner"):
        pipeline = PipelineStages(loaded, config, stages, meshes)
        # the sampler, the LM head and the step state on the last stage's devices
        last = dataclasses.replace(loaded, mesh=meshes[-1])
        return ModelRunner(last, config, executables=executables, stages=pipeline)


def make_proposer(config: EngineConfig, target: LoadedModel, draft: LoadedModel | None) -> Proposer:
    """The proposer of config.speculative (the no-op Proposer without it); draft: the draft
    model, EAGLE head or MTP head, on the target's mesh."""
    spec = config.speculative
    if spec is None:
        return Proposer()
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    sc = config.scheduler
    buckets = BucketTable.build(
        sc.max_num_seqs, sc.max_num_batched_tokens, k, coarse=envs.JAXSERVE_MINIMAL_COMPILE
    )
    args = (
        config.attention_backend,
        kv_cache_sharding(target.mesh),
        config.cache.block_size,
        list(buckets.seqs),
    )
    if spec.method in ("eagle", "eagle3"):
        return EagleProposer(draft, target.model, k, *args, buckets.max_sample_rows)
    if spec.method == "mtp":
        return MtpProposer(draft, target.model, k, *args, buckets.max_sample_rows)
    return DraftModelProposer(draft, k, *args)
