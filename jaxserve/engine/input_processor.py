"""Prompt -> validated EngineCoreRequest: tokenization, defaults and every check that names
the bad value, so nothing invalid ever reaches the engine core."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from jaxserve.config import DEFAULT_KV_TRANSFER_ALLOWED_HOSTS, EngineConfig, LoRAConfig
from jaxserve.distributed.kv_transfer.params import validate_kv_transfer_params
from jaxserve.ipc.messages import EngineCoreRequest
from jaxserve.lora_request import LoRARequest
from jaxserve.multimodal.inputs import MultiModalFeature, prompt_embeds_feature
from jaxserve.multimodal.processing import MultiModalProcessor
from jaxserve.sampling_params import MAX_BIAS_TOKENS, SamplingParams
from jaxserve.structured_output import validate_structured_outputs


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        max_logprobs: int,
        eos_token_id: int | None,
        kv_transfer_allowed_hosts: tuple[str, ...] = DEFAULT_KV_TRANSFER_ALLOWED_HOSTS,
        max_tokens_cap: int | None = None,
        lora: LoRAConfig | None = None,
        multimodal: Callable[[], MultiModalProcessor] | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        prompt_embeds_size: int | None = None,
    ):
        """max_tokens_cap: the generation config's max_new_tokens, a cap on every request's
        output tokens (vLLM's); lora: --enable-lora's config (None: adapters refused);
        multimodal: makes the model's image processor (None: a text-only model);
        limit_mm_per_prompt: the most images one prompt may carry (--limit-mm-per-prompt);
        prompt_embeds_size: the hidden size prompt embeddings have (--enable-prompt-embeds;
        None: refused)."""
        self.prompt_embeds_size = prompt_embeds_size
        self.tokenizer = tokenizer
        self._multimodal = multimodal
        self.limit_mm_per_prompt = limit_mm_per_prompt or {}
        self.lora = lora
        self.max_tokens_cap = max_tokens_cap
        self.kv_transfer_allowed_hosts = kv_transfer_allowed_hosts
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_id = eos_token_id

    @classmethod
    def from_config(
        cls, config: EngineConfig, tokenizer: Any, max_tokens_cap: int | None = None
    ) -> InputProcessor:
        """EOS: the tokenizer's, else the model config's (its first, when it lists several)."""
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        mm_config = getattr(config.model.hf_config, "multimodal_config", None)
        multimodal = None
        if mm_config is not None:
            multimodal = functools.partial(
                MultiModalProcessor, config.model.architecture, mm_config, config.model_path
            )
        limits = getattr(getattr(config, "multimodal", None), "limit_per_prompt", None)
        if eos is None:
            eos = getattr(config.model.hf_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) else eos
        return cls(
            tokenizer,
            vocab_size=config.model.vocab_size,
            max_model_len=config.scheduler.max_model_len,
            max_logprobs=config.max_logprobs,
            eos_token_id=eos,
            kv_transfer_allowed_hosts=config.kv_transfer_allowed_hosts,
            max_tokens_cap=max_tokens_cap,
            lora=config.lora,
            multimodal=multimodal,
            limit_mm_per_prompt=limits,
            prompt_embeds_size=config.model.hidden_size
            if getattr(config, "enable_prompt_embeds", False)
            else None,
        )

    @functools.cached_property
    def multimodal_processor(self) -> MultiModalProcessor | None:
        """The model's image processing (made on first use), or None: a text-only model."""
        return None if self._multimodal is None else self._multimodal(tokenizer=self.tokenizer)

    def prompt_extras(self, prompt: Any) -> dict[str, Any]:
        """A prompt dict's fields besides its text / ids, as `process` keywords (a
        prompt_embeds prompt's embeddings as its feature)."""
        if not isinstance(prompt, dict):
            return {}
        features = None
        if "prompt_embeds" in prompt:
            self._embeds_length(prompt["prompt_embeds"])
            features = [prompt_embeds_feature(prompt["prompt_embeds"], self.prompt_embeds_size)]
        return {
            "cache_salt": prompt.get("cache_salt"),
            "multi_modal_data": prompt.get("multi_modal_data"),
            "mm_processor_kwargs": prompt.get("mm_processor_kwargs"),
            "mm_features": prompt.get("mm_features", features),
        }

    def _embeds_length(self, embeds: Any) -> int:
        """A prompt_embeds' positions (its placeholder tokens); ValueError without the flag
        (the array itself is checked where it becomes the feature: prompt_embeds_feature)."""
        if self.prompt_embeds_size is None:
            raise ValueError("prompt_embeds need --enable-prompt-embeds (enable_prompt_embeds)")
        shape = np.shape(embeds)
        if len(shape) != 2:
            raise ValueError(
                f"prompt_embeds must be [positions, {self.prompt_embeds_size}], "
                f"got shape {list(shape)}"
            )
        return shape[0]

    def process_multimodal(
        self, prompt_token_ids: list[int], data: Any, kwargs: dict | None
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """A prompt's `multi_modal_data` ({"image": an image or a list}) -> the ids with each
        image's placeholder expanded, and the images' features."""
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict, got {type(data).__name__}")
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {sorted(unknown)[0]!r}")
        images = data.get("image")
        images = [] if images is None else images if isinstance(images, list) else [images]
        if not images:
            return prompt_token_ids, []
        if self.multimodal_processor is None:
            raise ValueError("this model is text-only: it does not take images")
        limit = self.limit_mm_per_prompt.get("image")
        if limit is not None and len(images) > limit:
            raise ValueError(
                f"At most {limit} image(s) may be provided in one prompt; got {len(images)}"
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be a dict, got {kwargs!r}")
        return self.multimodal_processor.process(prompt_token_ids, images, kwargs)

    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        """A prompt is a str, {"prompt": str}, {"prompt_token_ids": [int]} or
        {"prompt_embeds": [P, D]} (P placeholder ids; prompt_extras gives the embeddings)."""
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:  # checked by prompt_extras
            return None, [0] * self._embeds_length(prompt["prompt_embeds"])
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got {prompt}")
            text = prompt["prompt"]
            if prompt.get("multi_modal_data") and self.multimodal_processor is not None:
                if not isinstance(text, str):
                    raise ValueError(f"prompt must be a str, got {type(text).__name__}")
                self.check_text_length(text)
                expanded = self.multimodal_processor.expand_text(text)
                return text, self.tokenizer(expanded).input_ids
            prompt = text
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        self.check_text_length(prompt)
        return prompt, self.tokenizer(prompt).input_ids

    def check_text_length(self, text: str) -> None:
        """Refuse, without tokenizing it, a text too long to fit max_model_len whatever its
        tokens (a token spans at most _max_token_chars characters; x4 for normalisers that
        merge characters): a 10 MB prompt fails at once instead of blocking for seconds."""
        limit = 4 * self.max_model_len * self._max_token_chars
        if len(text) > limit:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(text)} characters (at least "
                f"{len(text) // (4 * self._max_token_chars)} tokens). Please reduce the length "
                "of the input."
            )

    @functools.cached_property
    def _max_token_chars(self) -> int:
        return max(8, max(map(len, self.tokenizer.get_vocab())))

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal_data: Any = None,
        mm_processor_kwargs: dict | None = None,
        mm_features: list | None = None,
    ) -> EngineCoreRequest:
        """kv_transfer_params: for the engine's KV connector (disaggregated prefill), only in
        the shape the proxy sends and naming only --kv-transfer-allowed-hosts;
        cache_salt: isolates the request's prefix-cache entries from other salts';
        lora_request: the adapter it runs with (needs --enable-lora);
        multi_modal_data: {"image": images} (PIL), one placeholder token per image in the
        prompt; mm_processor_kwargs: options of the model's image processor; mm_features:
        images processed already (`process_multimodal`'s, for the ids it expanded).
        Every integer that reaches a fixed-width array is bounded here (or capped, as vLLM
        does: top_k at the vocabulary)."""
        if mm_features and mm_features[0].modality == "embeds" and params.prompt_logprobs:
            raise ValueError("prompt_logprobs cannot be used with prompt_embeds")
        if params.truncate_prompt_tokens is not None:
            if mm_features or multi_modal_data:
                raise ValueError("truncate_prompt_tokens cannot be used with images")
            prompt_token_ids = self._truncate(prompt_token_ids, params.truncate_prompt_tokens)
        mm_features = list(mm_features or [])
        if any(not isinstance(f, MultiModalFeature) for f in mm_features):
            raise ValueError("mm_features must be MultiModalFeatures (process_multimodal's)")
        if multi_modal_data is not None:
            prompt_token_ids, mm_features = self.process_multimodal(
                list(prompt_token_ids), multi_modal_data, mm_processor_kwargs
            )
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if bad and type(bad[0]) is not int:  # a bool is an int to Python, not a token id
            raise ValueError(f"token ids must be integers, got {bad[0]!r}")
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {n} input tokens. Please reduce the length of the input."
            )
        cap = self.max_tokens_cap
        if params.max_tokens is None:
            room = self.max_model_len - n
            params = msgspec.structs.replace(
                params, max_tokens=room if cap is None else min(room, cap)
            )
        elif cap is not None and params.max_tokens > cap:
            params = msgspec.structs.replace(params, max_tokens=cap)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(  # vLLM's words
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                f"This model's maximum context length is {self.max_model_len} tokens and your "
                f"request has {n} input tokens ({params.max_tokens} > {self.max_model_len} - {n})."
            )
        if params.min_tokens > params.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={params.max_tokens}, "
                f"got {params.min_tokens}"
            )
        if params.top_k >= self.vocab_size:  # vLLM: a top_k past the vocabulary is no filter
            params = msgspec.structs.replace(params, top_k=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}={value} exceeds max_logprobs={self.max_logprobs}")
        if params.bad_words:
            params = msgspec.structs.replace(
                params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words)
            )
        token_lists = {
            "stop_token_ids": params.stop_token_ids or (),
            "logit_bias": params.logit_bias or (),  # its keys
            "allowed_token_ids": params.allowed_token_ids or (),
            "bad_words": [t for word in params.bad_words_token_ids or () for t in word],
        }
        for name, ids in token_lists.items():
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token id {bad[0]} is out of vocabulary (size {self.vocab_size})"
                )
        # The sampler's bias slots also carry min_tokens' blocks on EOS and stop_token_ids.
        blocked = {self.eos_token_id, *(params.stop_token_ids or [])} - {None}
        slots = set(params.logit_bias or {}) | (blocked if params.min_tokens else set())
        if len(slots) > MAX_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias has {len(params.logit_bias or {})} entries and min_tokens blocks "
                f"{len(blocked) if params.min_tokens else 0} stop tokens; together at most "
                f"{MAX_BIAS_TOKENS} token ids"
            )
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)
        if kv_transfer_params is not None:
            kv_transfer_params = validate_kv_transfer_params(
                kv_transfer_params, self.kv_transfer_allowed_hosts
            )
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit signed integer, got {priority}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        if lora_request is not None:
            self._validate_lora(lora_request)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            lora_request=lora_request,
            mm_features=mm_features or None,
        )

    def _validate_lora(self, lora_request: LoRARequest) -> None:
        """vLLM's checks: LoRA enabled, a positive id, a name and a path."""
        if self.lora is None:
            raise ValueError(
                f"got lora_request {lora_request.lora_name!r} but LoRA is not enabled: start "
                "the engine with enable_lora=True (--enable-lora)"
            )
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if not lora_request.lora_name or lora_request.lora_int_id < 1:
            raise ValueError(
                f"lora_request needs a name and a lora_int_id of at least 1, got "
                f"{lora_request.lora_name!r} / {lora_request.lora_int_id}"
            )
        if not lora_request.lora_path:
            raise ValueError(f"lora_request {lora_request.lora_name!r} has no lora_path")

    def _truncate(self, prompt_token_ids: list[int], k: int) -> list[int]:
        """The last k tokens (vLLM's truncate_prompt_tokens; -1: max_model_len)."""
        if k == -1:
            k = self.max_model_len
        if k > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                f"({self.max_model_len}). Please, select a smaller truncation size."
            )
        return prompt_token_ids[-k:]

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each word's tokens without and with a leading space (vLLM: so that the word is
        blocked at the start of the text and after a space), duplicates once."""
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer; this model has none")
        out: list[list[int]] = []
        for word in bad_words:
            for prefix in ("", " "):
                ids = self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
