"""A request's state inside the engine core."""

from __future__ import annotations

import enum
import time

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash, extend_block_hashes
from jaxserve.core.scheduler_output import PromptLogprobs
from jaxserve.lora_request import LoRARequest
from jaxserve.multimodal.inputs import MultiModalFeature
from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its structured-output grammar is being compiled
    WAITING_FOR_REMOTE_KVS = enum.auto()  # its KV is being fetched from another instance
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # an exception while serving it (vLLM's; the others go on)

    @property
    def is_finished(self) -> bool:
        return self > _PREEMPTED  # (a module constant: an enum class attribute is slow to read)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_PREEMPTED = int(RequestStatus.PREEMPTED)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None,
        block_size: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.lora_request = lora_request  # its LoRA adapter, or None
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        # The prefix-cache key of its first block: the cache salt and the adapter's name and
        # load id, so adapters (and reloads of one name) never share KV blocks.
        if lora_request is not None:
            cache_salt = f"{cache_salt or ''}\x00lora\x00{lora_request.cache_key}"
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params  # a KV connector's (distributed/kv_transfer)
        self.block_size = block_size
        # Its images, in prompt order (their placeholder tokens replaced by encoder outputs).
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())

        self.status = RequestStatus.WAITING
        self.structured_output_request = None  # StructuredOutputRequest when constrained
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or being computed)
        # Tokens being sampled by steps in flight, not yet known (async scheduling): the next
        # step may already run on them; the model runner feeds them from the device.
        self.num_output_placeholders = 0
        # In a micro-batch still in the pipeline (pipeline parallelism: the engine core's
        # batch queue): not scheduled again until that micro-batch's output is in
        self.in_pipeline = False
        self.spec_token_ids: list[int] = []  # drafts for the next step (speculative decoding)
        self.first_scheduled_time: float | None = None  # time.time() when first scheduled
        self.scheduled_time_sent = False
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling (-1: not yet)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # prompt_logprobs gathered chunk by chunk: arrays for positions 1 .. num_prompt_logprobs
        self.prompt_logprobs: list[PromptLogprobs] = []
        self.num_prompt_logprobs = 0
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(
            self.block_hashes, self.all_token_ids, block_size, cache_salt, self.mm_features
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.block_size:
            extend_block_hashes(  # a block was completed
                self.block_hashes,
                self.all_token_ids,
                self.block_size,
                self.cache_salt,
                self.mm_features,
            )

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keep a chunk's positions not seen yet (a request preempted mid-prompt recomputes
        from its start) and only the prompt_logprobs + 1 columns the request asked for."""
        skip = self.num_prompt_logprobs + 1 - chunk.first_position
        if skip < 0:
            raise RuntimeError(f"{self}: prompt logprobs skipped positions before {chunk}")
        cols = self.sampling_params.prompt_logprobs + 1
        if skip < len(chunk.ranks):
            self.prompt_logprobs.append(
                PromptLogprobs(
                    chunk.first_position + skip,
                    chunk.logprobs[skip:, :cols],
                    chunk.token_ids[skip:, :cols],
                    chunk.ranks[skip:],
                )
            )
            self.num_prompt_logprobs += len(chunk.ranks) - skip

    def take_prompt_logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All prompt positions' (logprobs [P-1, K+1], token ids [P-1, K+1], ranks [P-1]),
        once."""
        chunks, self.prompt_logprobs = self.prompt_logprobs, []
        cols = self.sampling_params.prompt_logprobs + 1
        if not chunks:
            return (
                np.zeros((0, cols), np.float32),
                np.zeros((0, cols), np.int32),
                np.zeros(0, np.int32),
            )
        return (
            np.concatenate([c.logprobs for c in chunks]),
            np.concatenate([c.token_ids for c in chunks]),
            np.concatenate([c.ranks for c in chunks]),
        )

    def take_scheduled_time(self) -> float | None:
        """When the request was first scheduled, in its first output only (queue time)."""
        if self.scheduled_time_sent:
            return None
        self.scheduled_time_sent = True
        return self.first_scheduled_time

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __lt__(self, other: Request) -> bool:
        """Priority-queue order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
