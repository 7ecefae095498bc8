"""The offline API: LLM(model).generate(prompts) / .chat(messages), as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
from tqdm.auto import tqdm

from jaxserve.config.pooler import is_classifier
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core_client import InprocClient
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints import score_utils
from jaxserve.entrypoints.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    check_beam_width,
)
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """An engine in this process: `LLM(model=None, **engine_args)`; see EngineArgs for the
    arguments (vLLM's names and defaults). model None or "HuggingFaceTB/SmolLM2-135M-Instruct"
    is the bundled default; otherwise a HF directory, a .gguf file or a jaxserve checkpoint."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        fields = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {', '.join(unknown)}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config (--generation-config, its override) sets
        what it names; SamplingParams' defaults the rest."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        kv_transfer_params: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """kv_transfer_params (one for every prompt, or one per prompt): for the engine's KV
        connector (disaggregated prefill); the outputs carry what it hands back.
        lora_request (one for every prompt, or one per prompt; needs enable_lora=True): the
        LoRA adapter each prompt runs with (None: the base model)."""
        if self.llm_engine.config.pooler is not None:
            raise ValueError("this LLM runs a pooling model (runner='pooling'): use LLM.embed()")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        sampling_params = sampling_params or self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
            )
        if kv_transfer_params is None or isinstance(kv_transfer_params, dict):
            kv_transfer_params = [kv_transfer_params] * len(prompts)
        if len(kv_transfer_params) != len(prompts):
            raise ValueError(
                f"got {len(kv_transfer_params)} kv_transfer_params for {len(prompts)} prompts"
            )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} lora_request for {len(prompts)} prompts")
        # Only the final outputs are returned: none are made for the steps before (vLLM's too).
        final = RequestOutputKind.FINAL_ONLY
        sampling_params = [msgspec.structs.replace(p, output_kind=final) for p in sampling_params]
        # Validate everything before anything is queued: a bad prompt fails alone, at once.
        engine = self.llm_engine
        queued = [
            engine.process_inputs(
                str(next(self._counter)), prompt, params, kv_transfer_params=kv, lora_request=lora
            )
            for prompt, params, kv, lora in zip(
                prompts, sampling_params, kv_transfer_params, lora_request, strict=True
            )
        ]
        engine.add_processed_requests(queued)
        return self._run_engine([request.request_id for _, request in queued], use_tqdm)

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (entrypoints/beam_search.py): each prompt's beam_width best
        sequences, best first; each sequence's `tokens` and `text` include the prompt's."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        processor = self.llm_engine.input_processor
        check_beam_width(params, processor.max_logprobs)
        ids = [processor.tokenize(p)[1] for p in prompts]
        search = BeamSearch(ids, params, processor.eos_token_id, processor.max_model_len)
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm)
        while not search.done:
            beams = [{"prompt_token_ids": t} for t in search.step_prompts()]
            search.advance(
                self.generate(
                    beams, search.sampling_params, use_tqdm=False, lora_request=lora_request
                )
            )
            bar.update(1)
        bar.close()
        tokenizer = self.get_tokenizer()
        return search.results(tokenizer.decode if tokenizer is not None else None)

    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text, {"prompt_token_ids": [...]}, or a list of them):
        the pooled final hidden state (PoolerConfig), normalised as pooling_params say."""
        self._pooling_model("LLM.embed()", "embed")
        pooler = self.llm_engine.config.pooler
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        pooling_params = pooling_params or PoolingParams()
        if isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompts)} prompts")
        for p in pooling_params:
            p.verify(self.llm_engine.config.model.hidden_size)
        outs = self._pool(prompts, use_tqdm)
        return [
            EmbeddingRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                EmbeddingOutput(params.apply(out.pooled, pooler.normalize)),
            )
            for out, params in zip(outs, pooling_params, strict=True)
        ]

    def classify(self, prompts: Any, *, use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's (text, {"prompt_token_ids": [...]}, or a list of them) probability
        per label, from a classifier (runner='pooling'; entrypoints/score_utils.py)."""
        hf_config = self._pooling_model("LLM.classify()", "classify").hf_config
        return [
            ClassificationRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                ClassificationOutput(score_utils.classify_probs(out.pooled, hf_config)),
            )
            for out in self._pool(prompts, use_tqdm)
        ]

    def score(
        self, text_1: str | list[str], text_2: str | list[str], *, use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """The score of each (text_1, text_2) pair (one and one, one and many, or many and as
        many): a cross-encoder's (a classifier of one label: the sigmoid of its logit over
        the pair as one prompt) or an embedding model's (the cosine similarity of the two
        texts' embeddings); entrypoints/score_utils.py."""
        model = self._pooling_model("LLM.score()", "score")
        firsts, seconds = score_utils.pair_up(text_1, text_2)
        if not is_classifier(model.architecture):  # a bi-encoder
            outs = self._pool(firsts + seconds, use_tqdm)
            pairs = zip(outs[: len(firsts)], outs[len(firsts) :], strict=True)
            return [
                ScoringRequestOutput(
                    f"{a.request_id}_{b.request_id}",
                    a.prompt_token_ids + b.prompt_token_ids,
                    ScoringOutput(score_utils.cosine(a.pooled, b.pooled)),
                )
                for a, b in pairs
            ]
        tokenizer, hf_config = self.get_tokenizer(), model.hf_config
        prompts = [
            {"prompt_token_ids": score_utils.cross_encoder_ids(tokenizer, hf_config, a, b)}
            for a, b in zip(firsts, seconds, strict=True)
        ]
        return [
            ScoringRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                ScoringOutput(score_utils.cross_encoder_score(out.pooled, hf_config)),
            )
            for out in self._pool(prompts, use_tqdm)
        ]

    def _pooling_model(self, what: str, task: str) -> Any:
        """The ModelConfig of a pooling model that serves `task`; else ValueError."""
        config = self.llm_engine.config
        if config.pooler is None:
            raise ValueError(f"{what} needs a pooling model: LLM(model, runner='pooling')")
        score_utils.check_task(config, task)
        return config.model

    def _pool(self, prompts: Any, use_tqdm: bool) -> list[RequestOutput]:
        """Each prompt's final output on a pooling runner (its `pooled` vector)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        one_step = SamplingParams(max_tokens=1, temperature=0.0)
        queued = [engine.process_inputs(str(next(self._counter)), p, one_step) for p in prompts]
        engine.add_processed_requests(queued)
        return self._run_engine([request.request_id for _, request in queued], use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """messages: one conversation or a list of them, each rendered with the chat template
        (chat_template, else the tokenizer's, else the model directory's). A message's content
        may hold image parts, as in vLLM: {"type": "image_url", "image_url": {"url": ...}}
        (http(s), data: or, under allowed_local_media_path, file://; fetched within
        $JAXSERVE_IMAGE_FETCH_TIMEOUT s each, at most 20 MiB) and {"type": "image_pil",
        "image_pil": PIL.Image}; at most limit_mm_per_prompt's of them per conversation."""
        from jaxserve.entrypoints.openai import chat_media

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template: use generate()")
        config = self.llm_engine.config
        chat_template = chat_template or chat_media.default_chat_template(tok, config)
        prompts = []
        for conversation in conversations:
            conversation, images = chat_media.extract_images(conversation, allow_pil=True)
            if images:
                conversation = self._image_conversation(conversation, images, chat_template)
            text = tok.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
            # The template already holds the special tokens: do not add BOS again.
            prompt = {
                "prompt": text,
                "prompt_token_ids": tok(text, add_special_tokens=False).input_ids,
            }
            if images:
                prompt["multi_modal_data"] = {"image": chat_media.load_images(images, config)}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _image_conversation(self, conversation: list, images: list, chat_template: str | None):
        """The messages of a conversation with images as its chat template takes them (image
        parts, or the model's marker in the text); ValueError past the image limit."""
        from jaxserve.entrypoints.openai import chat_media
        from jaxserve.entrypoints.openai.chat_utils import content_format, template_messages

        config = self.llm_engine.config
        chat_media.check_image_count(len(images), config)
        fmt = content_format(chat_template or self.get_tokenizer().chat_template, "auto")
        return template_messages(conversation, fmt, chat_media.image_placeholder(config.model))

    # ------------------------------------------------ sleep, new weights, runner calls
    # (docs/rl.md; engine/core_control.py runs them in the core between steps)
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the weights and the KV cache (needs
        enable_sleep_mode=True): level 1 keeps the weights on the host, level 2 reloads them
        from the checkpoint on wake_up. The prefix cache is emptied."""
        self._utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and the KV cache (tags: ["weights"] or ["kv_cache"], to
        wake one first)."""
        self._utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self._utility("is_sleeping"))

    def update_weights(self, weights: Any) -> dict:
        """New weights without a restart: a mapping (or a nested pytree: dict keys joined
        by dots) from names to arrays, all HF-named (a trainer's state_dict: built into the
        engine's layout, one copy) or all by the engine's names (`weight_layout()`: fused
        qkv / gate_up). With the core in this process (JAXSERVE_ENABLE_MULTIPROCESSING=0),
        jax.Arrays already in a parameter's dtype and sharding are adopted as they are, with
        no copy. The prefix cache is reset; nothing recompiles. Returns the parameters
        adopted and copied."""
        flat = _flatten(weights)
        if not isinstance(self.llm_engine.engine_core, InprocClient):  # to another process
            flat = {name: np.asarray(value) for name, value in flat.items()}
        return self._utility("update_weights", flat)

    def reload_weights(self, path: str | None = None) -> None:
        """Every weight read again from `path` (a HF directory or .gguf; default: the
        model's own checkpoint)."""
        self._utility("reload_weights", path)

    def weight_layout(self) -> dict[str, list]:
        """The engine's weights: name -> [shape, dtype] (what update_weights adopts)."""
        return self._utility("weight_layout")

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """Run a model-runner method (a name: one of core_control.COLLECTIVE_RPC_METHODS), or
        `method(runner, *args, **kwargs)`, on every worker; their results (vLLM's). timeout
        is accepted for vLLM's signature: the call waits for the core."""
        if callable(method):
            method = pickle.dumps(method)  # by reference: the core process imports it
        return self._utility("collective_rpc", method, list(args), kwargs or {})

    def _utility(self, method: str, *args: Any) -> Any:
        return self.llm_engine.engine_core.call_utility(method, *args)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start, generated = time.perf_counter(), 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"output {generated / elapsed:.1f} toks/s")
        except BaseException:  # e.g. KeyboardInterrupt: leave no request holding blocks
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A mapping of names to arrays, nested mappings' keys joined by dots."""
    if not isinstance(tree, Mapping):
        raise TypeError(f"weights must be a mapping of names to arrays, got {type(tree).__name__}")
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = getattr(value, "value", value)  # an nnx Variable's array
    return out
