"""The optional features a model runner's step is built with, in the order their hooks run
(worker/step_feature.py): adding a feature is its module and a line in `build_features`."""

from __future__ import annotations

from collections.abc import Iterator

from jaxserve.config import EngineConfig
from jaxserve.models.interfaces import supports_multimodal
from jaxserve.models.loader import LoadedModel
from jaxserve.worker.encoder_runner import EncoderRunner
from jaxserve.worker.kv_block_io import KVBlockCopier
from jaxserve.worker.kv_cache import KVCacheSpec
from jaxserve.worker.lora_slots import LoRASlots
from jaxserve.worker.pooler import Pooler
from jaxserve.worker.prompt_embeds import PromptEmbedsRunner
from jaxserve.worker.runner_protocol import EncoderCacheSpec
from jaxserve.worker.state_slots import StateSlots
from jaxserve.worker.step_feature import StepFeature


def build_features(loaded: LoadedModel, config: EngineConfig, kv: KVCacheSpec, rep) -> StepFeatures:
    """The features `config` asks for (before the model is split into the step's parameters:
    LoRA slots attach to its projections)."""
    sc, model = config.scheduler, loaded.model
    features: list[StepFeature] = []
    if config.lora is not None:  # adapters' device slots
        features.append(
            LoRASlots(model, config.lora, loaded.config, loaded.mesh, model.kv_replicas)
        )
    sizes = (sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len, loaded.mesh)
    if supports_multimodal(model):  # images into the encoder cache
        features.append(EncoderRunner(model, *sizes, config.model_path))
    elif config.enable_prompt_embeds:  # prompt embeddings, through the same cache
        features.append(PromptEmbedsRunner(model, *sizes))
    if config.cache.state_cache_slots:  # a hybrid model's states kept for prefix-cache hits
        features.append(StateSlots(sc.max_num_seqs, config.cache.state_cache_slots, kv.sharding))
    if config.kv_transfer is not None:  # a KV connector's block loads and saves
        features.append(KVBlockCopier(kv, -(-sc.max_model_len // config.cache.block_size)))
    if config.pooler is not None:  # embeddings and classifiers
        head = getattr(model, "classifier_head", None)  # a classifier's score head
        features.append(Pooler(config.pooler.pooling_type, sc.max_num_seqs, head, rep))
    return StepFeatures(features)


class StepFeatures:
    """A runner's features: iterated by its step, and looked up by kind where the engine core
    asks for one (None: the runner was built without it)."""

    def __init__(self, features: list[StepFeature]):
        self._features = features

    def __iter__(self) -> Iterator[StepFeature]:
        return iter(self._features)

    def get(self, kind: type) -> StepFeature | None:
        return next((f for f in self._features if isinstance(f, kind)), None)

    def lora(self) -> LoRASlots:
        lora = self.get(LoRASlots)
        if lora is None:
            raise ValueError("this engine was started without enable_lora")
        return lora

    def remove_lora(self, lora_int_id: int, live: set[int]) -> None:
        """Drop an adapter (nothing to drop without LoRA)."""
        lora = self.get(LoRASlots)
        if lora is not None:
            lora.remove_adapter(lora_int_id, live)

    def encoder_cache_spec(self) -> EncoderCacheSpec | None:
        """The encoder cache the scheduler sizes (None: no images, no prompt embeddings)."""
        encoder = self.get(EncoderRunner)
        if encoder is None:
            return None
        return EncoderCacheSpec(encoder.num_rows, encoder.budget, encoder.bidirectional)

    def check_images(self, images: list, architecture: str) -> None:
        encoder = self.get(EncoderRunner)
        if encoder is None:
            raise ValueError(f"{architecture} does not take images")
        encoder.check_images(images)
