"""The scheduler's rules for one request (vLLM V1's `core/sched/utils.py`): how many tokens
and drafts it may run in a step (and the StepPlan schedule() fills), and what a step's results
do to it (accepted drafts, the stop conditions, its grammar, the output sent back).

The limits are the request's max_tokens and the engine's max_model_len: a request never runs
a token whose sampled successor would pass either.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import CachedRequestData, NewRequestData
from jaxserve.ipc.messages import EngineCoreOutput

if TYPE_CHECKING:
    from jaxserve.config import SchedulerConfig
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from jaxserve.ipc.messages import SpecDecodingStats
    from jaxserve.structured_output import StructuredOutputManager


@dataclasses.dataclass
class StepPlan:
    """What one schedule() call has decided so far; its phases fill it in turn."""

    budget: int  # tokens the step may still run
    draft_room: int  # draft tokens it may still run (see draft_room)
    num_scheduled: dict[str, int] = dataclasses.field(default_factory=dict)  # req_id -> tokens
    new_reqs: list[NewRequestData] = dataclasses.field(default_factory=list)
    cached_reqs: list[CachedRequestData] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    spec_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # At most this many requests (a pipeline's micro-batch); once reached the budget is held
    # back (0) so the phases stop, and given back if a preemption unschedules one
    max_reqs: int | None = None
    held_budget: int = 0

    def schedule_running(
        self, request: Request, num_tokens: int, drafts: list[int], new_block_ids: tuple
    ) -> None:
        """A running request's next num_tokens (its drafts the last of them), in its blocks
        and new_block_ids (sent as a diff: CachedRequestData)."""
        self._schedule(request.request_id, num_tokens)
        if drafts:
            self.spec_tokens[request.request_id] = drafts
            self.draft_room -= len(drafts)
        self.cached_reqs.append(
            CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
        )

    def schedule_decode(self, request: Request) -> None:
        """schedule_running of a decode without drafts or new blocks (the common case)."""
        req_id = request.request_id
        self.num_scheduled[req_id] = 1
        self.budget -= 1
        self.cached_reqs.append(CachedRequestData(req_id, (), request.num_computed_tokens))
        if self.max_reqs is not None:
            self._hold_at_max()

    def schedule_new(self, request: Request, num_tokens: int, block_ids: tuple) -> None:
        """A request admitted from the waiting queue, sent in full (NewRequestData)."""
        self._schedule(request.request_id, num_tokens)
        self.new_reqs.append(
            NewRequestData(
                request.request_id,
                request.prompt_token_ids,
                list(request.output_token_ids),
                request.sampling_params,
                block_ids,
                request.num_computed_tokens,
                request.eos_token_id,
                request.lora_int_id,
                request.mm_features,
            )
        )

    def _schedule(self, req_id: str, num_tokens: int) -> None:
        self.num_scheduled[req_id] = num_tokens
        self.budget -= num_tokens
        if self.max_reqs is not None:
            self._hold_at_max()

    def _hold_at_max(self) -> None:
        if len(self.num_scheduled) >= self.max_reqs and self.budget > 0:
            self.held_budget, self.budget = self.budget, 0

    def unschedule(self, victim: Request) -> None:
        """A request preempted in this step: undo what the step gave it earlier, if anything."""
        self.preempted.append(victim)
        if victim.request_id in self.num_scheduled:
            self.budget += self.num_scheduled.pop(victim.request_id) + self.held_budget
            self.held_budget = 0
            self.spec_tokens.pop(victim.request_id, None)
            self.cached_reqs = [c for c in self.cached_reqs if c.req_id != victim.request_id]


def num_tokens_to_schedule(request: Request, max_model_len: int) -> int:
    """Tokens a running request can run now: the rest of its prompt, or its last token
    (known or a placeholder). Nothing when a placeholder may already be its last token, or
    while it is in a micro-batch still in the pipeline."""
    if request.in_pipeline:
        return 0
    if request.num_output_placeholders > 1 and not runs_ahead_of_drafts(request):
        return 0  # its drafted step in flight (async scheduling) must be fetched first
    if request.num_output_placeholders:
        max_tokens = request.sampling_params.max_tokens
        n_out = request.num_output_tokens + request.num_output_placeholders
        if (max_tokens is not None and n_out >= max_tokens) or (
            request.num_tokens_with_placeholders >= max_model_len
        ):
            return 0
    return request.num_tokens_with_placeholders - request.num_computed_tokens


def draft_room(
    running: list[Request], budget: int, draft_step_tokens: int | None, config: SchedulerConfig
) -> int:
    """Draft tokens a step may hold (see Scheduler's draft_step_tokens): the running
    requests' other tokens first, drafts then up to their power of two or draft_step_tokens."""
    if draft_step_tokens is None:
        return budget
    n = sum(num_tokens_to_schedule(r, config.max_model_len) for r in running)
    return max(1 << max(n - 1, 0).bit_length(), draft_step_tokens) - n


def pick_victim(running: list[Request], policy: str) -> Request:
    """The running request a preemption takes: the lowest priority (policy "priority"; the
    latest arrival among equals) or the latest scheduled (fcfs)."""
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]


def decodes_in_place(request: Request, kv: KVCacheManager, lookahead: int) -> bool:
    """Whether a running request's next token (a decode: no drafts, no images) fits the KV
    blocks it holds, lookahead included: nothing to allocate or cache, so the scheduler plans
    it without the rest of its per-request work (the common case at large batch)."""
    if request.spec_token_ids or request.mm_features:
        return False
    return kv.fits(request, 1 + lookahead)


def drafts_to_schedule(
    request: Request, num_new: int, budget: int, max_model_len: int, drafts_ahead: int = 0
) -> list[int]:
    """The request's drafts that may run after its next token: only in a decode step
    (num_new == 1), within the token budget, and short enough that the token sampled
    after them stays within max_tokens and max_model_len (its in-flight drafts counted as
    accepted). While its previous step is in flight, drafts_ahead placeholders (-1: the
    drafts the device proposes after that step; 0: none), if it may run ahead of them."""
    if num_new != 1:
        return []
    drafts = request.spec_token_ids
    if request.num_output_placeholders:
        drafts = [-1] * drafts_ahead if runs_ahead_of_drafts(request) else []
    if not drafts:
        return []
    limit = min(budget, max_model_len - request.num_tokens_with_placeholders) - 1
    if request.sampling_params.max_tokens is not None:
        n_out = request.num_output_tokens + request.num_output_placeholders
        limit = min(limit, request.sampling_params.max_tokens - n_out - 1)
    return drafts[: max(limit, 0)]


def runs_ahead_of_drafts(request: Request) -> bool:
    """Whether a request may run while a step with its drafts is in flight (async
    scheduling): its sampling needs no count of its tokens on the host, which does not know
    how many drafts that step accepts (no seed, penalty, longer bad word, grammar, or
    min_tokens still to reach)."""
    p = request.sampling_params
    return (
        p.seed is None
        and not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
        and not any(len(w) > 1 for w in p.bad_words_token_ids or ())
        and request.structured_output_request is None
        and request.num_output_tokens >= p.min_tokens
    )


def update_request_from_step(
    request: Request,
    so: SchedulerOutput,
    ro: ModelRunnerOutput,
    row: int,
    token: int,
    max_model_len: int,
    grammars: StructuredOutputManager | None,
    spec_stats: SpecDecodingStats | None,
) -> EngineCoreOutput | None:
    """Apply a step's results to the request ro.req_ids[row] (`token`: its sampled token,
    ro.sampled_token_ids[row]): its prompt logprobs; then, if
    the step kept its sampled token, its new tokens (through the stop conditions and its
    grammar) and its next drafts. Returns its output for the frontend, None for a mid-prompt
    chunk (nothing to send)."""
    req_id = request.request_id
    if ro.prompt_logprobs and req_id in ro.prompt_logprobs:
        request.add_prompt_logprobs(ro.prompt_logprobs[req_id])
    if req_id not in so.sampled_req_ids:
        return None
    request.num_output_placeholders -= 1 + len(so.scheduled_spec_decode_tokens.get(req_id, ()))
    new_tokens = [token]
    if so.scheduled_spec_decode_tokens:
        new_tokens = accepted_tokens(request, so, ro, token, spec_stats)
    if len(new_tokens) == 1 and (grammars is None or request.structured_output_request is None):
        # a plain decode, the common case: inline
        request.append_output_token_ids(token)
        check_stop(request, token, max_model_len)
    else:
        update_request_with_output(request, new_tokens, max_model_len, grammars)
    if request.num_output_placeholders:  # a later step in flight: its drafts are on the device
        request.spec_token_ids = []
    elif ro.spec_token_ids and request.status == RequestStatus.RUNNING:
        drafts = ro.spec_token_ids.get(req_id, [])
        if grammars is not None:  # only what its grammar allows
            drafts = grammars.valid_drafts(request, drafts)
        request.spec_token_ids = drafts
    return make_engine_core_output(request, new_tokens, ro, row)


def accepted_tokens(
    request: Request,
    so: SchedulerOutput,
    ro: ModelRunnerOutput,
    token: int,
    spec_stats: SpecDecodingStats | None,
) -> list[int]:
    """The step's new tokens for a request: its accepted drafts, then its sampled token;
    the rejected drafts' positions are no longer computed (their KV slots are reused)."""
    drafts = so.scheduled_spec_decode_tokens.get(request.request_id)
    if not drafts:
        return [token]
    accepted = ro.accepted_drafts[request.request_id]
    if request.status == RequestStatus.RUNNING:  # (a preempted one recomputes from 0)
        request.num_computed_tokens -= len(drafts) - len(accepted)
    spec_stats.observe(len(drafts), len(accepted))
    return [*accepted, token]


def update_request_with_output(
    request: Request,
    new_tokens: list[int],
    max_model_len: int,
    grammars: StructuredOutputManager | None,
) -> None:
    """Append a step's new tokens (accepted drafts, then the sampled one) to the request, each
    through the stop conditions and its grammar; at the first that finishes it, the rest are
    cut from new_tokens (drafts accepted past a stop are not output)."""
    for i, token in enumerate(new_tokens):
        request.append_output_token_ids(token)
        check_stop(request, token, max_model_len)
        if not request.is_finished and grammars is not None and grammars.advance(request, token):
            request.status = RequestStatus.FINISHED_STOPPED
        if request.is_finished:
            del new_tokens[i + 1 :]
            break


def check_stop(request: Request, token: int, max_model_len: int) -> None:
    """Finish the request if `token`, just appended, ends it: EOS or a stop token (once
    min_tokens are out), max_tokens or max_model_len."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if token == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if params.stop_token_ids and token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return
    if (params.max_tokens is not None and num_output >= params.max_tokens) or len(
        request.all_token_ids
    ) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED


def make_engine_core_output(
    request: Request, new_tokens: list[int], runner_output: ModelRunnerOutput, row: int
) -> EngineCoreOutput:
    """What the frontend gets for the request from one step: its new tokens, their logprobs
    if asked for, its prompt's logprobs with its first token, and its finish reason."""
    params = request.sampling_params
    logprobs = None
    if params.logprobs is not None:
        logprobs = runner_output.logprobs_of(row, len(new_tokens), params.logprobs + 1)
    prompt_logprobs = None
    if params.prompt_logprobs is not None and request.num_output_tokens == 1:  # once
        prompt_logprobs = request.take_prompt_logprobs()
    return EngineCoreOutput(
        request.request_id,
        new_tokens,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=request.num_cached_tokens,
        pooled=runner_output.pooled.get(request.request_id) if runner_output.pooled else None,
        scheduled_time=None if request.scheduled_time_sent else request.take_scheduled_time(),
        num_preemptions=request.num_preemptions,
    )


def lora_gate(running: list[Request], max_loras: int):
    """For one admission pass: request -> whether admitting it would put more than max_loras
    distinct LoRA adapters into the running set (vLLM's rule: such a request waits; max_loras
    0: LoRA is off). The running set's adapters are gathered once; a request let through
    counts as admitted (a pass stops at the first that does not fit)."""
    loras = {r.lora_int_id for r in running if r.lora_int_id} if max_loras else set()

    def blocked(request: Request) -> bool:
        lora_id = request.lora_int_id
        if not max_loras or not lora_id or lora_id in loras:
            return False
        if len(loras) >= max_loras:
            return True
        loras.add(lora_id)
        return False

    return blocked


def lora_stats(running, waiting, max_loras: int) -> dict:
    """SchedulerStats' adapter fields (vLLM's lora_requests_info): requests per adapter name,
    running and waiting; nothing when LoRA is off (max_loras 0)."""
    if not max_loras:
        return {}

    def count(requests) -> dict[str, int]:
        return dict(
            collections.Counter(
                r.lora_request.lora_name for r in requests if r.lora_request is not None
            )
        )

    return {
        "running_lora_adapters": count(running),
        "waiting_lora_adapters": count(waiting),
        "max_loras": max_loras,
    }
