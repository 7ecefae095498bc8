"""What the scheduler hands the model runner each step, and what comes back.

As in vLLM V1, a request is sent in full once (`NewRequestData`, or again when it resumes from
preemption) and afterwards only as a diff (`CachedRequestData`: its new blocks and how many
tokens are computed), so the runner keeps each request's state in its persistent input batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming from preemption
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # each KV-cache group's (config/kv_groups.py)
    num_computed_tokens: int
    eos_token_id: int | None = None
    lora_int_id: int = 0  # its LoRA adapter (0: none)
    mm_features: list = dataclasses.field(default_factory=list)  # its images (MultiModalFeature)


@dataclasses.dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: tuple[list[int], ...]  # each group's new blocks; () when none has any
    num_computed_tokens: int


@dataclasses.dataclass
class KVConnectorMetadata:
    """One step's copies for a KV connector (distributed/kv_transfer): (block id, block
    array) to load into the KV cache before the forward, (block id, hash) to save after it."""

    loads: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
    saves: list[tuple[int, BlockHash]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to run this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the last step: drop their state
    preempted_req_ids: set[str]  # preempted this step: drop their state too
    # Requests whose sampled token is kept (the step reaches the end of their known tokens).
    sampled_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Of those, the requests with a structured-output grammar: the step's sampling waits for
    # their token bitmask (Scheduler.grammar_bitmask, once every earlier step is processed).
    structured_output_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Speculative decoding: the draft tokens scheduled after each request's last token (they
    # are counted in num_scheduled_tokens and in num_computed_tokens until rejected).
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # A KV connector's copies for the step (built by its build_connector_meta).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Images: the features (indices into each request's mm_features) whose encoder runs this
    # step, before the forward (vLLM's scheduled_encoder_inputs), and the encoder-cache rows
    # of every image whose placeholder tokens the step runs (its identifier -> i32[length]).
    scheduled_encoder_inputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    encoder_rows: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # A hybrid model's kept linear-attention states (core/state_cache.py): the slot each newly
    # admitted request's row is restored from before the forward, and the slot each request's
    # row is copied into after the step (worker/state_slots.py).
    state_restores: dict[str, int] = dataclasses.field(default_factory=dict)
    state_saves: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PromptLogprobs:
    """Logprobs of prompt positions first_position .. first_position + N - 1 (each scored as
    the next token after the one before it), in the sampler's [sampled/target, top-K] layout."""

    first_position: int
    logprobs: np.ndarray  # f32[N, K+1]: the prompt token, then the top-K
    token_ids: np.ndarray  # i32[N, K+1]
    ranks: np.ndarray  # i32[N]: the prompt token's rank


@dataclasses.dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step, in the order of `req_ids`.

    A request whose prompt is still being prefilled in chunks gets a token too; the scheduler
    discards it. Logprob arrays are None unless a request in the batch asked for them.
    """

    req_ids: list[str]
    # The token sampled after each request's accepted drafts (its only token without drafts).
    sampled_token_ids: np.ndarray  # i32[num_reqs]
    # Per sampling row (a request's rows start at first_row: one, plus one per draft; an
    # accepted draft's row holds that draft's logprobs): the sampled token, then top-K.
    logprobs: np.ndarray | None = None  # f32[num_rows, K+1]
    logprob_token_ids: np.ndarray | None = None  # i32[num_rows, K+1]
    sampled_ranks: np.ndarray | None = None  # i32[num_rows]
    first_row: np.ndarray | None = None  # i32[num_reqs], with the logprob arrays
    # Requests that asked for prompt_logprobs and ran prompt positions this step.
    prompt_logprobs: dict[str, PromptLogprobs] = dataclasses.field(default_factory=dict)
    # A pooling runner's f32[D] per request whose prompt ended this step.
    pooled: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # Speculative decoding: each drafted request's accepted drafts (they come before its
    # sampled token; a draft scheduled as a placeholder is known only here), and the next
    # drafts the proposer made.
    accepted_drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def logprobs_of(
        self, row: int, num_tokens: int, k: int
    ) -> list[tuple[list[float], list[int], int]]:
        """The first k logprob columns (the token, then the top k - 1) and the token's rank,
        for req_ids[row]'s first num_tokens sampling rows (its accepted drafts', then its
        sampled token's)."""
        first = self.first_row[row]
        return [
            (
                self.logprobs[r, :k].tolist(),
                self.logprob_token_ids[r, :k].tolist(),
                int(self.sampled_ranks[r]),
            )
            for r in range(first, first + num_tokens)
        ]
