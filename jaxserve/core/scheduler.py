"""Continuous batching with one token budget, chunked prefill and preemption by recompute.

Each step (vLLM V1's schedule()):
  1. Running requests first, in order: each gets its remaining tokens (1 for a decode, the rest
     of its prompt for a chunked prefill) up to the budget. If the KV pool cannot hold them, the
     lowest-priority (policy "priority") or latest-arrived (fcfs) running request is preempted:
     its blocks are freed, it goes back to the front of the waiting queue and will recompute.
  2. Then waiting requests, while budget, max_num_seqs and free blocks allow: each first takes
     its longest prefix-cache hit, then its prompt, split across steps when longer than the
     remaining budget.
No waiting request is admitted in a step that preempted one. `update_from_output` appends the
sampled tokens, applies the stop conditions and frees finished requests' blocks.

Speculative decoding: a running request in decode also runs the draft tokens the proposer made
after its last step (`Request.spec_token_ids`) when they fit the budget and its limits; they
count as computed until the step's output says how many were accepted, then the rest are
rolled back and the accepted ones are appended before the sampled token.

Async scheduling (EngineCore keeps one step in flight): step N+1 is scheduled before step N's
sampled tokens are known. A step that completes a request's known tokens leaves an output
placeholder on it; the next step may then run the request on that placeholder (the model runner
takes the token from the device) unless it would pass max_tokens or max_model_len. When N's
token arrives, a request that stopped has its N+1 token dropped.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from jaxserve.ipc.messages import EngineCoreOutput, SchedulerStats, SpecDecodingStats
from jaxserve.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from jaxserve.distributed.kv_transfer.base import KVConnectorBase

logger = logging.getLogger(__name__)


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: str):
        self.priority = policy == "priority"
        self._items: deque[Request] | list[Request] = [] if self.priority else deque()

    def add(self, request: Request) -> None:
        if self.priority:
            heapq.heappush(self._items, request)
        else:
            self._items.append(request)

    def add_front(self, request: Request) -> None:
        """A preempted request: first in line under fcfs, by its rank under priority."""
        if self.priority:
            heapq.heappush(self._items, request)
        else:
            self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return heapq.heappop(self._items) if self.priority else self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)
        if self.priority:
            heapq.heapify(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative: bool = False,
        num_lookahead_tokens: int = 0,
        draft_step_tokens: int | None = None,
        connector: KVConnectorBase | None = None,
    ):
        """speculative: drafts are scheduled (Request.spec_token_ids); num_lookahead_tokens:
        KV slots kept free after each request's tokens for a draft model's proposals;
        draft_step_tokens: drafts only fill a step up to the power of two its other tokens
        need, or up to this many tokens (None: no limit but the budget). A draft token costs
        a forward token and a sampling row: nearly free while the step is bound by reading the
        weights (few tokens), a full token's compute once it is not (many)."""
        self.config = scheduler_config
        self.structured_output_manager = structured_output_manager
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            sliding_window=cache_config.sliding_window,
        )  # fmt: skip
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.pending_outputs: list[EngineCoreOutput] = []  # finished outside a step
        self.num_preemptions = 0  # since the last stats snapshot
        self.total_preemptions = 0
        self.spec_stats = SpecDecodingStats() if speculative else None  # since the last stats
        self.num_lookahead_tokens = num_lookahead_tokens
        self.draft_step_tokens = draft_step_tokens
        self.connector = connector
        # Requests whose KV is being fetched from another instance: they hold their blocks,
        # and rejoin the front of the waiting queue when it arrives (or fails).
        self.waiting_for_remote: dict[str, Request] = {}

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("this engine has no structured-output backend")
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise finish) requests wherever they are; unknown ids are ignored."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_remote[req_id]
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> dict | None:
        """Release a finished request; returns its KV connector's kv_transfer_params."""
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return self.connector.request_finished(request) if self.connector else None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    # ------------------------------------------------------------------ schedule
    def schedule(self, max_tokens: int | None = None) -> SchedulerOutput:
        """max_tokens: a lower token budget for this step (the runner's start-up is still
        compiling the forwards of larger steps: ModelRunner.max_step_tokens)."""
        budget = self.config.max_num_batched_tokens
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}
        draft_room = self._draft_room(budget)
        kv = self.kv_cache_manager
        if self.connector is not None:
            self._finish_remote_loads()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(self._num_tokens_to_schedule(request), budget)
            if num_new == 0:
                i += 1
                continue
            drafts = self._drafts_to_schedule(request, num_new, min(budget, 1 + draft_room))
            request.spec_token_ids = []  # used now or never
            n = num_new + len(drafts)
            ahead = self._lookahead(request.num_computed_tokens + n)
            new_blocks = kv.allocate_slots(request, n, num_lookahead_tokens=ahead)
            if new_blocks is None and drafts:  # no room for the drafts: run without them
                drafts = []
                new_blocks = kv.allocate_slots(
                    request,
                    num_new,
                    num_lookahead_tokens=self._lookahead(request.num_computed_tokens + num_new),
                )
            num_new += len(drafts)
            while new_blocks is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in num_scheduled:  # scheduled earlier in this step: undo
                    budget += num_scheduled.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                    cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(
                    request,
                    num_new,
                    num_lookahead_tokens=self._lookahead(request.num_computed_tokens + num_new),
                )
            if new_blocks is None:
                continue  # `request` itself was preempted; running[i] is the next one now
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if drafts:
                spec_tokens[request.request_id] = drafts
                draft_room -= len(drafts)
            cached_reqs.append(
                CachedRequestData(
                    request.request_id,
                    [b.block_id for b in new_blocks],
                    request.num_computed_tokens,
                )
            )
            i += 1

        skipped: list[Request] = []  # still compiling their grammar: they keep their place
        while (
            not preempted
            and len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output_request.is_ready:
                    skipped.append(self.waiting.pop())
                    continue
                if not self._grammar_compiled(request):  # finished, off the queue
                    continue
            assert not request.num_output_placeholders, request  # resolved before readmission
            num_external, load_async = 0, False
            if request.request_id in kv.req_to_blocks:  # back from a remote load: has blocks
                computed_blocks, num_computed = [], request.num_computed_tokens
            else:
                computed_blocks, num_computed = kv.get_computed_blocks(request)
                if self.connector is not None:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(
                        request, num_computed
                    )
            if load_async:  # its KV comes from another instance: wait for it off the queue
                if not self._wait_for_remote(request, computed_blocks, num_computed, num_external):
                    break
                continue
            num_new = min(request.num_tokens - num_computed - num_external, budget)
            lookahead = self._lookahead(num_computed + num_external + num_new)
            new_blocks = kv.allocate_slots(
                request, num_external + num_new, computed_blocks, num_computed,
                num_lookahead_tokens=lookahead,
            )  # fmt: skip
            if new_blocks is None:
                break
            if num_external:  # loaded into its blocks before this step's forward
                self.connector.update_state_after_alloc(
                    request, kv.get_block_ids(request.request_id), num_computed, num_external
                )
                num_computed += num_external
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    list(request.output_token_ids),
                    request.sampling_params,
                    kv.get_block_ids(request.request_id),
                    num_computed,
                    request.eos_token_id,
                )
            )

        for request in reversed(skipped):
            self.waiting.add_front(request)

        # The tokens are as good as computed: the next schedule() may already plan after them.
        # A step that reaches the end of a request's tokens samples its next one.
        sampled = set()
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens_with_placeholders:
                request.num_output_placeholders += 1
                sampled.add(req_id)
        kv_connector_metadata = None
        if self.connector is not None:
            kv_connector_metadata = self.connector.build_connector_meta(
                [self.requests[r] for r in num_scheduled], kv.get_block_ids
            )
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            sampled_req_ids=sampled,
            structured_output_req_ids={
                r for r in sampled if self.requests[r].structured_output_request is not None
            },
            scheduled_spec_decode_tokens=spec_tokens,
            kv_connector_metadata=kv_connector_metadata,
        )
        self.finished_req_ids = set()
        return output

    def _wait_for_remote(
        self, request: Request, computed_blocks: list, num_computed: int, num_external: int
    ) -> bool:
        """Give a waiting request the blocks for its device hit and the KV another instance
        will send, and park it until the KV arrives; False if the blocks do not fit."""
        kv = self.kv_cache_manager
        new_blocks = kv.allocate_slots(
            request, num_external, computed_blocks, num_computed, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        self.waiting.pop()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_computed
        self.waiting_for_remote[request.request_id] = request
        self.connector.update_state_after_alloc(
            request, kv.get_block_ids(request.request_id), num_computed, num_external
        )
        return True

    def _finish_remote_loads(self) -> None:
        """Requests whose remote KV arrived rejoin the front of the waiting queue with it
        counted as computed (a partial or failed load leaves the rest to compute); a failed
        load under kv_load_failure_policy "fail" finishes the request (aborted)."""
        for req_id, loaded in self.connector.get_finished_recving().items():
            request = self.waiting_for_remote.pop(req_id, None)
            if request is None:
                continue
            if loaded is None and self.connector.config.kv_load_failure_policy == "fail":
                logger.error("request %s: its remote KV could not be loaded", req_id)
                request.status = RequestStatus.FINISHED_ABORTED
                self._free(request)
                self.pending_outputs.append(EngineCoreOutput(req_id, [], "abort"))
                continue
            request.num_computed_tokens += loaded or 0
            request.status = RequestStatus.WAITING
            self.waiting.add_front(request)

    def _grammar_compiled(self, request: Request) -> bool:
        """A WAITING_FOR_FSM request whose compile is done: True if it may be scheduled; a
        failed compile finishes it (aborted, reported with the next outputs)."""
        so = request.structured_output_request
        if so.future.exception() is not None:
            logger.error("request %s: %s", request.request_id, so.future.exception())
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free(request)
            self.pending_outputs.append(EngineCoreOutput(request.request_id, [], "abort"))
            return False
        request.status = RequestStatus.WAITING
        return True

    @property
    def num_waiting_for_grammar(self) -> int:
        return sum(r.status == RequestStatus.WAITING_FOR_FSM for r in self.waiting)

    def grammar_bitmask(
        self, req_ids: list[str], sampled_req_ids: set[str], first_rows, drafts, num_rows: int
    ):
        """The step's token bitmask, i32[num_rows, ceil(V/32)] (one row per sampling row: a
        request's first_rows[i], then one per draft), or None when no request whose token the
        step keeps is constrained (see StructuredOutputManager.grammar_bitmask)."""
        if self.structured_output_manager is None:
            return None
        requests = [self.requests.get(r) if r in sampled_req_ids else None for r in req_ids]
        return self.structured_output_manager.grammar_bitmask(
            requests, first_rows, drafts, num_rows
        )

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _num_tokens_to_schedule(self, request: Request) -> int:
        """Tokens a running request can run now: the rest of its prompt, or its last token
        (known or a placeholder). Nothing when a placeholder may already be its last token."""
        if request.num_output_placeholders:
            max_tokens = request.sampling_params.max_tokens
            n_out = request.num_output_tokens + request.num_output_placeholders
            if (max_tokens is not None and n_out >= max_tokens) or (
                request.num_tokens_with_placeholders >= self.config.max_model_len
            ):
                return 0
        return request.num_tokens_with_placeholders - request.num_computed_tokens

    def _lookahead(self, end: int) -> int:
        """KV slots to keep after a request's first `end` tokens for a draft model's
        proposals, up to max_model_len."""
        return max(0, min(self.num_lookahead_tokens, self.config.max_model_len - end))

    def _draft_room(self, budget: int) -> int:
        """Draft tokens this step may hold (see draft_step_tokens): running requests' other
        tokens first, drafts then up to their power of two or draft_step_tokens."""
        if self.spec_stats is None:
            return 0
        if self.draft_step_tokens is None:
            return budget
        n = sum(self._num_tokens_to_schedule(r) for r in self.running)
        return max(1 << max(n - 1, 0).bit_length(), self.draft_step_tokens) - n

    def _drafts_to_schedule(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts that may run after its next token: only in a decode step
        (num_new == 1), within the token budget, and short enough that the token sampled
        after them stays within max_tokens and max_model_len."""
        drafts = request.spec_token_ids
        if not drafts or num_new != 1 or request.num_output_placeholders:
            return []
        limit = min(budget, self.config.max_model_len - request.num_tokens) - 1
        if request.sampling_params.max_tokens is not None:
            limit = min(limit, request.sampling_params.max_tokens - request.num_output_tokens - 1)
        return drafts[: max(limit, 0)]

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        if self.connector is not None:
            self.connector.request_preempted(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.add_front(request)

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests, free their blocks."""
        outputs = self.take_pending_outputs()
        for row, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None:  # finished or aborted while the step ran
                continue
            if req_id in runner_output.prompt_logprobs:
                request.add_prompt_logprobs(runner_output.prompt_logprobs[req_id])
            if req_id not in scheduler_output.sampled_req_ids:  # mid-prompt chunk
                continue
            request.num_output_placeholders -= 1
            new_tokens = self._accepted_tokens(request, scheduler_output, runner_output, row)
            for i, token in enumerate(new_tokens):
                request.append_output_token_ids(token)
                self._check_stop(request, token)
                if not request.is_finished and self._advance_grammar(request, token):
                    request.status = RequestStatus.FINISHED_STOPPED
                if request.is_finished:
                    del new_tokens[i + 1 :]  # drafts accepted past a stop are not output
                    break
            if request.status == RequestStatus.RUNNING:
                drafts = runner_output.spec_token_ids.get(req_id, [])
                if self.structured_output_manager is not None:  # only what its grammar allows
                    drafts = self.structured_output_manager.valid_drafts(request, drafts)
                request.spec_token_ids = drafts
            logprobs = None
            if request.sampling_params.logprobs is not None:
                k, first = request.sampling_params.logprobs + 1, runner_output.first_row[row]
                rows = range(first, first + len(new_tokens))  # accepted drafts', then sampled
                logprobs = [
                    (
                        runner_output.logprobs[r, :k].tolist(),
                        runner_output.logprob_token_ids[r, :k].tolist(),
                        int(runner_output.sampled_ranks[r]),
                    )
                    for r in rows
                ]
            prompt_logprobs = None
            if request.sampling_params.prompt_logprobs is not None and (
                request.num_output_tokens == 1  # sent with the first token, once
            ):
                prompt_logprobs = request.take_prompt_logprobs()
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_tokens,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=request.num_cached_tokens,
                    pooled=runner_output.pooled.get(req_id),
                    scheduled_time=self._take_scheduled_time(request),
                )
            )
            if request.is_finished:
                if request in self.running:
                    self.running.remove(request)
                else:  # preempted while its token was in flight
                    self.waiting.remove(request)
                if kv_transfer_params := self._free(request):
                    outputs[-1].kv_transfer_params = kv_transfer_params
        return outputs

    def _accepted_tokens(
        self, request: Request, so: SchedulerOutput, ro: ModelRunnerOutput, row: int
    ) -> list[int]:
        """The step's new tokens for a request: its accepted drafts, then its sampled token;
        the rejected drafts' positions are no longer computed (their KV slots are reused)."""
        sampled = [int(ro.sampled_token_ids[row])]
        drafts = so.scheduled_spec_decode_tokens.get(request.request_id)
        if not drafts:
            return sampled
        accepted = ro.num_accepted_drafts[request.request_id]
        request.num_computed_tokens -= len(drafts) - accepted
        self.spec_stats.observe(len(drafts), accepted)
        return drafts[:accepted] + sampled

    @staticmethod
    def _take_scheduled_time(request: Request) -> float | None:
        """When the request was first scheduled, in its first output only (queue time)."""
        if request.scheduled_time_sent:
            return None
        request.scheduled_time_sent = True
        return request.first_scheduled_time

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Feed a kept token to the request's grammar; True when the grammar is complete (or
        broken: a token it did not allow, e.g. min_tokens blocking the EOS it demanded)."""
        manager = self.structured_output_manager
        if manager is None or not manager.should_advance(request):
            return False
        grammar = request.structured_output_request.grammar
        if not grammar.accept_tokens([token]):
            logger.warning("request %s: token %d breaks its grammar", request.request_id, token)
            return True
        return grammar.is_terminated()

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if params.stop_token_ids and token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return
        if (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ) or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def make_stats(self) -> SchedulerStats:
        stats: PrefixCacheStats = self.kv_cache_manager.make_prefix_cache_stats()
        preemptions, self.num_preemptions = self.num_preemptions, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_preemptions=preemptions,
            spec_decoding=self._take_spec_stats(),
            kv_connector=self.connector.take_stats() if self.connector is not None else None,
        )

    def _take_spec_stats(self) -> SpecDecodingStats | None:
        stats = self.spec_stats
        if stats is not None:
            self.spec_stats = SpecDecodingStats()
        return stats
