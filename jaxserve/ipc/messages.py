"""Messages between the frontend and the engine core (msgspec Structs, msgpack on the wire)."""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

from jaxserve.lora_request import LoRARequest
from jaxserve.multimodal.inputs import MultiModalFeature
from jaxserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request: what the input processor sends to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    client_index: int = 0  # which frontend (API server) gets the outputs
    data_parallel_rank: int | None = None  # pin to this engine (else the load balancer picks)
    # Disaggregated prefill (distributed/kv_transfer): vLLM's request field, e.g. a prefill
    # instance's {"do_remote_decode": true} or a decode instance's {"do_remote_prefill": true,
    # "remote_host": ..., "remote_port": ...} (what the prefill instance's response carried).
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (--enable-lora)
    # Its images, processed (their placeholders expanded in prompt_token_ids), in order.
    mm_features: list[MultiModalFeature] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (stop strings: frontend)
    # Per new token (accepted drafts make several): (logprobs [K+1], token ids [K+1], sampled
    # rank), the sampled token first, then the top-K.
    logprobs: list[tuple[list[float], list[int], int]] | None = None
    # With the first token only: prompt positions 1.. as (f32[P-1, K+1] logprobs, i32[P-1, K+1]
    # token ids, i32[P-1] ranks), each row the prompt token first, then the top-K.
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    num_cached_tokens: int = 0
    pooled: np.ndarray | None = None  # a pooling runner's f32[D] for the prompt (unnormalised)
    scheduled_time: float | None = None  # first output only: when first scheduled (time.time())
    # The finished output only: what a KV connector tells the next instance (the prefill
    # instance's {"do_remote_prefill": true, "remote_host": ..., ...}), sent on by the proxy.
    kv_transfer_params: dict[str, Any] | None = None
    num_preemptions: int = 0  # times it was preempted so far (last: omitted while 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Speculative decoding since the last stats: drafts scored, their tokens, how many were
    accepted, and how often the draft at each position (0 = the first) was accepted."""

    num_drafts: int = 0  # request-steps that scored at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1


class KVConnectorStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A KV connector's counts since the last stats (distributed/kv_transfer)."""

    connector: str = ""  # its name: the metrics' label
    queries: int = 0  # tokens looked up past the device prefix-cache hit
    hits: int = 0  # of those, tokens it had
    loaded_blocks: int = 0  # blocks copied into the KV cache
    saved_blocks: int = 0  # blocks copied out of it
    failed_loads: int = 0  # requests whose KV did not arrive (recomputed or failed)
    block_bytes: int = 0  # one block's bytes


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # the queue and the requests waiting for remote KV (vLLM's)
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up since the last stats
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0  # since the last stats
    spec_decoding: SpecDecodingStats | None = None  # set when speculative decoding is on
    kv_connector: KVConnectorStats | None = None  # set with a KV connector
    # --enable-lora: requests per adapter name, running and waiting (vLLM's lora_requests_info)
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None
    max_loras: int = 0
    # Steps dispatched and not yet fetched when this step's output was taken, it included
    # (the engine core's batch queue: pipeline_parallel_size micro-batches in steady decode)
    num_batches_in_flight: int = 0
    # Of num_waiting_reqs, those held back by something else than room in the batch: a grammar
    # still compiling, KV coming from another instance, no LoRA slot (vLLM's "deferred")
    num_deferred_reqs: int = 0


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The answer to a UtilityRequest: its result, or the error it raised."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the core sends back after a step (or to answer a utility call): every request's
    news, the scheduler's state and when the step finished (time.time(), for TTFT / ITL)."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    engine_index: int = 0  # which data-parallel engine sent it


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every frontend -> core message; the rest is the payload's frames."""

    ADD = b"\x00"  # list[EngineCoreRequest]: added in order (e.g. all of one generate() call)
    ABORT = b"\x01"  # list[str] of request ids
    UTILITY = b"\x02"  # UtilityRequest


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """Call EngineCore.<method>(*args) in the core process; answered with a UtilityOutput."""

    call_id: int
    method: str
    args: list[Any] = []


# The core sends this single frame on its output socket when it dies (the engine group's
# monitor sends it for a core that was killed).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class DPEngineState(msgspec.Struct, array_like=True, omit_defaults=True):
    """A data-parallel engine's load, pushed to the DP coordinator after every step and every
    change of its queues. start_wave: it has work while it believes the engines paused."""

    engine_index: int
    num_waiting: int
    num_running: int
    start_wave: bool = False


class DPLoadState(msgspec.Struct, array_like=True, omit_defaults=True):
    """The coordinator's view, published to every frontend: [waiting, running] per engine,
    the wave number (how many times all engines went idle) and whether a wave runs."""

    counts: list[list[int]]
    wave: int = 0
    engines_running: bool = False


class DPWave(msgspec.Struct, array_like=True, omit_defaults=True):
    """Coordinator -> engines: wave `wave` runs (every engine steps, idle ones a dummy step,
    while any has work) or has ended (all idle)."""

    wave: int
    running: bool
