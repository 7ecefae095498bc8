"""The offline API: LLM(model).generate(prompts) / .chat(messages), as in vLLM."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import jax
import msgspec
from tqdm.auto import tqdm

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.models.loader import load_model
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

DEFAULT_MODEL_NAMES = (None, "HuggingFaceTB/SmolLM2-135M-Instruct")


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        max_logprobs: int = 20,
        scheduling_policy: str = "fcfs",
    ):
        on_cpu = jax.default_backend() == "cpu"  # smaller defaults: fewer shapes to compile
        self.loaded = load_model(
            None if model in DEFAULT_MODEL_NAMES else model,
            dtype=dtype, tensor_parallel_size=tensor_parallel_size,
        )  # fmt: skip
        cfg = self.loaded.config
        if tokenizer is not None:
            from transformers import AutoTokenizer

            self.loaded.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        max_model_len = max_model_len or cfg.max_model_len
        if max_model_len > cfg.max_model_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's {cfg.max_model_len}"
            )
        self.scheduler_config = SchedulerConfig(
            max_model_len,
            max_num_seqs=max_num_seqs or (64 if on_cpu else 256),
            max_num_batched_tokens=max_num_batched_tokens or (1024 if on_cpu else 8192),
            policy=scheduling_policy,
        )
        self.cache_config = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
        )
        self.engine = EngineCore(
            self.loaded, self.scheduler_config, self.cache_config,
            max_logprobs=max_logprobs, seed=seed,
        )  # fmt: skip
        tok = self.loaded.tokenizer
        self.input_processor = InputProcessor(
            tok, vocab_size=cfg.vocab_size, max_model_len=max_model_len,
            max_logprobs=max_logprobs,
            eos_token_id=tok.eos_token_id if tok is not None else cfg.hf_config.eos_token_id,
        )  # fmt: skip
        self.output_processor = OutputProcessor(tok)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.loaded.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM: the model's generation_config fills what the user left unset."""
        gen = self.loaded.generation_config
        if gen is None:
            return SamplingParams()
        fields = {
            "temperature": "temperature",
            "top_p": "top_p",
            "top_k": "top_k",
            "repetition_penalty": "repetition_penalty",
            "max_new_tokens": "max_tokens",
        }
        defaults = {
            ours: getattr(gen, theirs)
            for theirs, ours in fields.items()
            if getattr(gen, theirs, None) is not None and theirs in gen.to_diff_dict()
        }
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        sampling_params = sampling_params or self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
            )
        # Validate everything before anything is queued: a bad prompt fails alone, at once.
        queued = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            text, ids = self.input_processor.tokenize(prompt)
            request_id = str(next(self._counter))
            request = self.input_processor.process(request_id, ids, params)
            queued.append((request_id, text, request))
        for request_id, text, request in queued:
            core_ids = self.output_processor.add_request(
                request_id, text, request.prompt_token_ids, request.sampling_params,
                request.arrival_time,
            )  # fmt: skip
            for i, core_id in enumerate(core_ids):
                params = request.sampling_params
                if params.n > 1 and params.seed is not None:  # distinct, reproducible children
                    params = msgspec.structs.replace(params, seed=params.seed + i)
                self.engine.add_request(
                    msgspec.structs.replace(request, request_id=core_id, sampling_params=params)
                )
        return self._run_engine([r for r, _, _ in queued], use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.loaded.tokenizer
        prompts = []
        for conversation in conversations:
            text = tok.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )  # fmt: skip
            # The template already holds the special tokens: do not add BOS again.
            prompts.append(
                {"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids}
            )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start, generated = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            core_outputs = self.engine.step()
            generated += sum(len(o.new_token_ids) for o in core_outputs)
            outputs, to_abort = self.output_processor.process_outputs(core_outputs)
            if to_abort:
                self.engine.abort_requests(to_abort)
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} toks/s")
        bar.close()
        return [finished[r] for r in request_ids]
