"""Continuous batching with one token budget, chunked prefill and preemption by recompute.

Each step, `schedule()` (vLLM V1's) fills a StepPlan (core/scheduler_utils.py) in three phases:
  1. `_schedule_running`: running requests first, in order: each gets its remaining tokens (1
     for a decode, the rest of its prompt for a chunked prefill) up to the budget. If the KV
     pool cannot hold them, the lowest-priority (policy "priority") or latest-arrived (fcfs)
     running request is preempted: its blocks are freed, it goes back to the front of the
     waiting queue (core/request_queue.py) and will recompute.
  2. `_schedule_waiting`: then waiting requests, while budget, max_num_seqs and free blocks
     allow: each first takes its longest prefix-cache hit, then its prompt, split across steps
     when longer than the remaining budget. Not in a step that preempted a request, and none
     whose LoRA adapter would make the running set hold more than max_loras adapters.
  3. `_make_output`: the scheduled tokens count as computed; the step's SchedulerOutput.
`update_from_output` applies each request's results (the sampled tokens and the stop conditions:
scheduler_utils.update_request_from_step) and frees finished requests' blocks.

Failure isolation: an exception in one request's work (its KV connector calls, its grammar,
its results) finishes it alone, FINISHED_ERROR (the exception in its stop_reason, as vLLM),
blocks freed; only what is no one request's (the model runner's step) kills the engine.

Speculative decoding: a decoding request also runs its drafts (`Request.spec_token_ids`)
when they fit the budget and its limits; they count as computed until the step's output says
how many were accepted, then the rest are rolled back.

Async scheduling (EngineCore keeps one step in flight): step N+1 is scheduled before step N's
sampled tokens are known. A step that completes a request's known tokens leaves output
placeholders on it (its token, and its drafts counted as accepted); the next step may run
the request on them (the runner reads them on the device), with drafts_ahead placeholder
drafts, unless that could pass max_tokens or max_model_len (or its sampling needs its tokens
counted: scheduler_utils.runs_ahead_of_drafts); if N's tokens stop the request, N+1's are
dropped; N's rejected drafts are uncounted when N is fetched (the runner moved N+1 back).
"""

from __future__ import annotations

import logging
import time

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.encoder_cache_manager import EncoderCacheManager
from jaxserve.core.kv_cache_manager import KVCacheManager, block_ids
from jaxserve.core.kv_connector import NoKVConnector, SchedulerKVConnector
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.request_queue import create_request_queue
from jaxserve.core.scheduler_gates import GrammarGate
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.core.scheduler_remote import RemoteKVLoads
from jaxserve.core.scheduler_stats import make_stats
from jaxserve.core.scheduler_utils import (
    StepPlan,
    decodes_in_place,
    draft_room,
    drafts_to_schedule,
    lora_gate,
    num_tokens_to_schedule,
    pick_victim,
    update_request_from_step,
)
from jaxserve.core.state_cache import step_gate
from jaxserve.ipc.messages import EngineCoreOutput, SpecDecodingStats
from jaxserve.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """The engine core's request states (waiting, running, waiting for remote KV) and each
    step's plan; see the module docstring for the order of things."""

    make_stats = make_stats  # what it reports after a step (scheduler_stats.py)

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative: bool = False,
        drafts_ahead: int = 0,
        num_lookahead_tokens: int = 0,
        draft_step_tokens: int | None = None,
        connector: SchedulerKVConnector | None = None,
        max_loras: int = 0,
        encoder_cache: EncoderCacheManager | None = None,
    ):
        """speculative: drafts are scheduled (Request.spec_token_ids); drafts_ahead: k, the
        placeholder drafts a request runs while its previous step is in flight (async
        scheduling with drafts the devices propose; 0: none); num_lookahead_tokens:
        KV slots kept free after each request's tokens for a draft model's proposals;
        draft_step_tokens: drafts only fill a step up to the power of two its other tokens
        need, or up to this many tokens (None: no limit but the budget; a draft costs little
        while a step reads weights, a full token's compute once it does not). max_loras: the
        distinct LoRA adapters the running set may hold (0: LoRA off); encoder_cache: the
        image encoder outputs' rows (a multimodal model's), and a hybrid model's kept states
        (cache_config.state_cache_slots): `self.gate`'s (core/state_cache.py::step_gate)."""
        self.max_loras = max_loras
        self.config = scheduler_config
        self.grammars = GrammarGate(structured_output_manager)
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.layout.groups,
        )
        self.gate = step_gate(encoder_cache, cache_config.state_cache_slots, self.kv_cache_manager)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.pending_outputs: list[EngineCoreOutput] = []  # finished outside a step
        self.num_preemptions, self.total_preemptions = 0, 0  # (since the last stats; in all)
        self.num_skipped = 0  # waiting requests the last admission pass went past
        self.spec_stats = SpecDecodingStats() if speculative else None  # since the last stats
        self.num_lookahead_tokens = num_lookahead_tokens
        self.drafts_ahead = drafts_ahead
        self.draft_step_tokens = draft_step_tokens
        self.connector = connector or NoKVConnector()
        # Requests holding their blocks while their KV comes from another instance
        self.remote = RemoteKVLoads(self.kv_cache_manager, self.waiting)

    @property
    def waiting_for_remote(self) -> dict[str, Request]:
        return self.remote.requests

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        if request.sampling_params.structured_outputs is not None:
            try:
                self.grammars.start(request)
                request.status = RequestStatus.WAITING_FOR_FSM
            except Exception as e:
                self.pending_outputs.append(self._fail(request, e))

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
                self.waiting.remove_request(request)
            request.status = status
            self._free_logged(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> dict | None:
        """Release a finished request; returns its KV connector's kv_transfer_params. Its
        blocks and state are gone before the connector is told (which may raise)."""
        self.kv_cache_manager.free(request)
        self.gate.release(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return self.connector.request_finished(request)

    def _free_logged(self, request: Request) -> None:
        """_free for a request that ends without a response to carry kv_transfer_params: a
        connector's error is logged (the request is finished either way)."""
        try:
            self._free(request)
        except Exception:
            logger.exception("request %s: the KV connector failed to let it go", request)

    def _fail(self, request: Request, error: Exception) -> EngineCoreOutput:
        """Finish a request whose own work raised `error` (FINISHED_ERROR), wherever it is,
        its blocks freed; returns its output (finish_reason "error", the error as stop_reason)."""
        logger.error("request %s failed: %r", request.request_id, error, exc_info=error)
        if request in self.running:
            self.running.remove(request)
        elif self.waiting_for_remote.pop(request.request_id, None) is None and (
            request in self.waiting
        ):
            self.waiting.remove_request(request)
        request.status = RequestStatus.FINISHED_ERROR
        if request.request_id in self.requests:
            self._free_logged(request)
        return EngineCoreOutput(request.request_id, [], "error", f"{type(error).__name__}: {error}")

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    # ------------------------------------------------------------------ schedule
    def schedule(
        self, max_tokens: int | None = None, max_reqs: int | None = None
    ) -> SchedulerOutput:
        """One step's plan: the running requests, then the waiting ones, then the output.
        max_tokens: a lower token budget for this step (the runner's start-up is still
        compiling the forwards of larger steps: ModelRunner.max_step_tokens); max_reqs: at
        most this many requests (a pipeline's micro-batch, engine/core.py)."""
        budget = self.config.max_num_batched_tokens
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        plan = StepPlan(budget, 0, max_reqs=max_reqs)
        if self.spec_stats is not None:
            plan.draft_room = draft_room(self.running, budget, self.draft_step_tokens, self.config)
        self.gate.begin_step()
        self.pending_outputs.extend(self.remote.finish(self.connector, self._fail))
        self._schedule_running(plan)
        if not plan.preempted:  # no waiting request is admitted in a step that preempted one
            self._schedule_waiting(plan)
        return self._make_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Phase 1: each running request, in order, gets its next tokens (and its drafts when
        they fit), preempting from the back of the line while the KV pool cannot hold them."""
        i, running, kv = 0, self.running, self.kv_cache_manager  # (running: changed in place)
        while i < len(running) and plan.budget > 0:
            request = running[i]
            num_new = min(num_tokens_to_schedule(request, self.config.max_model_len), plan.budget)
            start = request.num_computed_tokens
            ahead = self._lookahead(start + 1) if self.num_lookahead_tokens else 0
            if num_new == 1 and not self.drafts_ahead and decodes_in_place(request, kv, ahead):
                plan.schedule_decode(request)  # the common case: nothing to allocate
                i += 1
                continue
            num_new, encoder_work = self.gate.plan(request, start, num_new)
            if num_new == 0:
                i += 1
                continue
            drafts = drafts_to_schedule(
                request,
                num_new,
                min(plan.budget, 1 + plan.draft_room),
                self.config.max_model_len,
                self.drafts_ahead,
            )
            request.spec_token_ids = []  # used now or never
            new_blocks = self._allocate_running(request, num_new + len(drafts))
            if new_blocks is None and drafts:  # no room for the drafts: run without them
                drafts = []
                new_blocks = self._allocate_running(request, num_new)
            num_new += len(drafts)
            while new_blocks is None:
                victim = pick_victim(self.running, self.config.policy)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                plan.unschedule(victim)
                if victim is request:
                    break
                new_blocks = self._allocate_running(request, num_new)
            if new_blocks is None:
                continue  # `request` itself was preempted; running[i] is the next one now
            self.gate.commit(request, start, num_new, encoder_work)
            plan.schedule_running(request, num_new, drafts, block_ids(new_blocks))
            i += 1

    def _allocate_running(self, request: Request, num_new: int) -> tuple | None:
        """KV blocks for a running request's next num_new tokens (and the lookahead after
        them); None when the pool cannot hold them."""
        ahead = self._lookahead(request.num_computed_tokens + num_new)
        return self.kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=ahead)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Phase 2: admit waiting requests in queue order while the budget, max_num_seqs and
        the KV pool allow; a request whose grammar is still compiling keeps its place."""
        skipped: list[Request] = []
        lora_blocked = lora_gate(self.running, self.max_loras)
        while (
            len(self.waiting) and plan.budget > 0 and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output_request.is_ready:
                    skipped.append(self.waiting.pop_request())
                    continue
                if (error := self.grammars.error(request)) is not None:
                    self.pending_outputs.append(self._fail(request, error))
                    continue  # finished, off the queue
                request.status = RequestStatus.WAITING
            if lora_blocked(request):  # its adapter waits for a slot
                skipped.append(self.waiting.pop_request())
                continue
            try:
                admitted = self._admit(request, plan)
            except Exception as e:  # its KV connector's calls: it alone fails
                self.pending_outputs.append(self._fail(request, e))
                continue
            if not admitted:
                break
        for request in reversed(skipped):
            self.waiting.prepend_request(request)
        self.num_skipped = len(skipped)  # (deferred: scheduler_stats.py)

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Schedule the waiting request at the head of the queue: its prefix-cache hit, the
        tokens a KV connector supplies, then as much of the rest as the budget allows (or
        park it while its KV comes from another instance). False when its blocks do not fit:
        the queue waits for the next step."""
        assert not request.num_output_placeholders, request  # resolved before readmission
        kv = self.kv_cache_manager
        if request.request_id in kv.req_to_blocks:  # back from a remote load: has blocks
            computed_blocks, num_computed = kv.no_blocks(), request.num_computed_tokens
            num_external, load_async = 0, False
        else:
            computed_blocks, num_computed = kv.get_computed_blocks(request, self.gate.trim_hit)
            num_external, load_async = self.connector.get_num_new_matched_tokens(
                request, num_computed
            )
        if load_async:  # its KV comes from another instance: wait for it off the queue
            return self.remote.park(
                self.connector, request, computed_blocks, num_computed, num_external
            )
        num_new = min(request.num_tokens - num_computed - num_external, plan.budget)
        num_new, encoder_work = self.gate.plan(request, num_computed + num_external, num_new)
        if num_new == 0 and request.num_tokens > num_computed + num_external:
            return False  # its next image waits for encoder budget or cache rows
        lookahead = self._lookahead(num_computed + num_external + num_new)
        new_blocks = kv.allocate_slots(
            request,
            num_external + num_new,
            computed_blocks,
            num_computed,
            num_lookahead_tokens=lookahead,
        )
        if new_blocks is None:
            return False
        if num_external:  # loaded into its blocks before this step's forward
            self.connector.update_state_after_alloc(
                request, kv.connector_block_ids(request.request_id), num_computed, num_external
            )
            num_computed += num_external
        self.gate.commit(request, num_computed, num_new, encoder_work)
        self.waiting.pop_request()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        plan.schedule_new(request, num_new, kv.get_block_ids(request.request_id))
        return True

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        """Phase 3: count the scheduled tokens as computed (the next schedule() may already
        plan after them) and describe the step for the model runner and the KV connector."""
        sampled = set()  # a step that reaches the end of a request's tokens samples its next
        encoder_rows = {}
        requests = self.requests
        for req_id, n in plan.num_scheduled.items():
            request = requests[req_id]
            self.gate.rows(request, n, encoder_rows)
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens_with_placeholders:
                # its sampled token and, until the step is fetched, its drafts all accepted
                request.num_output_placeholders += 1 + len(plan.spec_tokens.get(req_id, ()))
                sampled.add(req_id)
        kv_connector_metadata = self.connector.build_connector_meta(
            [requests[r] for r in plan.num_scheduled], self.kv_cache_manager.connector_block_ids
        )
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted},
            sampled_req_ids=sampled,
            structured_output_req_ids={
                r for r in sampled if self.requests[r].structured_output_request is not None
            },
            scheduled_spec_decode_tokens=plan.spec_tokens,
            kv_connector_metadata=kv_connector_metadata,
            **self.gate.take_inputs(),  # its encoder inputs (and state copies)
            encoder_rows=encoder_rows,
        )
        self.finished_req_ids = set()
        return output

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _lookahead(self, end: int) -> int:
        """KV slots to keep after a request's first `end` tokens for a draft model's
        proposals, up to max_model_len."""
        return max(0, min(self.num_lookahead_tokens, self.config.max_model_len - end))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.gate.release(request)
        try:
            self.connector.request_preempted(request)
        except Exception:  # it recomputes from scratch: nothing of the connector's is used
            logger.exception("request %s: the KV connector failed on its preemption", request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.prepend_request(request)

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests, free their blocks."""
        outputs = self.take_pending_outputs()
        tokens = runner_output.sampled_token_ids.tolist()
        rules = (self.config.max_model_len, self.grammars.manager, self.spec_stats)
        for row, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None:  # finished or aborted while the step ran
                continue
            try:
                so, ro = scheduler_output, runner_output
                output = update_request_from_step(request, so, ro, row, tokens[row], *rules)
            except Exception as e:  # its grammar, its logprobs, ...: it alone fails
                outputs.append(self._fail(request, e))
                continue
            if output is None:  # mid-prompt chunk
                continue
            outputs.append(output)
            if request.is_finished:
                if request in self.running:
                    self.running.remove(request)
                else:  # preempted while its token was in flight
                    self.waiting.remove_request(request)
                try:
                    output.kv_transfer_params = self._free(request)
                except Exception as e:  # its response would lack the connector's params
                    outputs[-1] = self._fail(request, e)
        return outputs

    @property
    def num_waiting_for_grammar(self) -> int:
        return sum(r.status == RequestStatus.WAITING_FOR_FSM for r in self.waiting)

    def grammar_bitmask(
        self, req_ids: list[str], sampled_req_ids: set[str], first_rows, drafts, num_rows: int
    ):
        """GrammarGate.bitmask over the requests whose token the step keeps, in order."""
        requests = [self.requests.get(r) if r in sampled_req_ids else None for r in req_ids]
        return self.grammars.bitmask(requests, first_rows, drafts, num_rows)
