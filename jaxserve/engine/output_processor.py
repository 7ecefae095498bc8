"""Turns the core's per-step EngineCoreOutputs into users' RequestOutputs.

Per request: detokenize incrementally, match stop strings (a match finishes the request here
and tells the caller to abort it in the core), gather logprobs, and emit CUMULATIVE, DELTA or
FINAL_ONLY outputs. A request with n > 1 runs as n child requests in the core
("{i}_{request_id}", sharing the prompt's cached blocks through prefix caching); the parent
output gathers them, in index order.

A request that failed (finish_reason "error" from the core, or an exception while its outputs
were processed here) ends at once: its output is finished, every completion "error" with the
error as stop_reason, and its children still in the core are aborted; the others go on.

With a tracer (--otlp-traces-endpoint) every request that ends (finished, aborted or failed)
also becomes one span, in its caller's trace when it came with W3C trace context (tracing.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.ipc.messages import EngineCoreOutput, EngineCoreRequest
from jaxserve.metrics.stats import FinishedRequestStats, IterationStats
from jaxserve.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tracing import RequestTracer, log_tracing_disabled_warning

logger = logging.getLogger(__name__)


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def _finished_stats(state: RequestState, reason: str, now: float) -> FinishedRequestStats:
    """A finished request for the metrics; with n children, abort if any was aborted, else
    stop if any stopped, else length (a failed request: error)."""
    m, params, sampled = state.metrics, state.params, state.pooled is None
    lengths = [len(c.token_ids) for c in state.children.values()]
    first, scheduled, last = m.first_token_time, m.first_scheduled_time, m.last_token_time
    return FinishedRequestStats(
        reason,
        now - m.arrival_time,
        m.queue_time,
        len(state.prompt_token_ids),
        sum(lengths),
        max(lengths, default=0),
        prefill_time=first - scheduled if first is not None and scheduled is not None else None,
        decode_time=last - first if first is not None and last is not None else None,
        inference_time=last - scheduled if last is not None and scheduled is not None else None,
        num_preemptions=sum(c.num_preemptions for c in state.children.values()),
        n=params.n if sampled else None,
        max_tokens=params.max_tokens if sampled else None,
    )


@dataclasses.dataclass
class ChildState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    finish_sent: bool = False  # for DELTA outputs: its last output went out
    num_preemptions: int = 0  # times the core preempted it (the metrics)


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # [None, position 1, ...]
    prompt_logprobs_sent: bool = False  # for DELTA outputs
    pooled: Any = None  # a pooling runner's f32[D]
    kv_transfer_params: dict[str, Any] | None = None  # the first child's, when it finished
    trace_headers: Mapping[str, str] | None = None  # W3C trace context: its span's parent

    @property
    def finished(self) -> bool:
        for c in self.children.values():  # noqa: SIM110 (a loop: it runs per request and step)
            if c.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, tracer: RequestTracer | None = None):
        """tracer: a span per finished request (--otlp-traces-endpoint, jaxserve/tracing.py)."""
        self.tokenizer = tokenizer
        self.tracer = tracer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        prompt: str | None,
        request: EngineCoreRequest,
        trace_headers: Mapping[str, str] | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a request; returns what to send to the core: the request itself, or its n
        child requests ("{i}_{id}"; seeded children get seed + i, distinct and reproducible).
        trace_headers: the W3C trace context its span joins (with a tracer)."""
        if trace_headers and self.tracer is None:
            log_tracing_disabled_warning()
        request_id, params, prompt_token_ids = (
            request.request_id,
            request.sampling_params,
            request.prompt_token_ids,
        )
        children, core_requests = {}, []
        for i in range(params.n):
            core_id = request_id if params.n == 1 else child_request_id(i, request_id)
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                if self.tokenizer is not None
                else None
            )
            children[core_id] = ChildState(
                i, detok, logprobs=[] if params.logprobs is not None else None
            )
            if params.logprobs is not None:
                children[core_id].cumulative_logprob = 0.0
            self.child_to_parent[core_id] = request_id
            child = params
            if params.n > 1 and params.seed is not None:
                child = msgspec.structs.replace(params, seed=params.child_seed(i))
            core_requests.append(
                msgspec.structs.replace(request, request_id=core_id, sampling_params=child)
            )
        self.requests[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            children,
            RequestMetrics(request.arrival_time),
            trace_headers=trace_headers,
        )
        return core_requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str, stats: IterationStats | None = None) -> list[str]:
        """Forget a request (client gone); returns the core ids still to abort. Counted in
        `stats` as finished with reason "abort"."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for core_id in state.children:
            self.child_to_parent.pop(core_id, None)
        self._finished(state, "abort", time.time(), stats)
        return [cid for cid, c in state.children.items() if c.finish_reason is None]

    def process_outputs(
        self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (RequestOutputs to deliver, core request ids to abort: stop strings and
        failed requests); counts tokens, TTFT, ITL and finished requests into `stats` when
        given. A request whose output raises here fails alone (see the module docstring)."""
        now = time.time()
        stats = stats if stats is not None else IterationStats()
        stats.engine_step |= bool(outputs)
        to_abort: list[str] = []
        touched: dict[str, RequestState] = {}
        failed: dict[str, RequestState] = {}
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None or parent_id in failed:
                continue  # aborted by the user meanwhile, or failed in this very call
            state = self.requests[parent_id]
            try:
                if self._process_one(state, out, stats, now, to_abort):
                    touched[parent_id] = state
                error = out.stop_reason if out.finish_reason == "error" else None
            except Exception as e:  # its detokenizer, stop strings, logprobs: it alone fails
                logger.exception("request %s: its outputs could not be processed", parent_id)
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                touched.pop(parent_id, None)
                failed[parent_id] = state
                to_abort += self._fail(state, error, now, stats)

        results = [self._failed_output(state) for state in failed.values()]
        for parent_id, state in touched.items():
            finished = state.finished
            kind = state.params.output_kind
            output = None
            try:
                if finished or kind != RequestOutputKind.FINAL_ONLY:
                    output = self._make_output(state, finished, kind == RequestOutputKind.DELTA)
            except Exception as e:
                logger.exception("request %s: its output could not be made", parent_id)
                to_abort += self._fail(state, f"{type(e).__name__}: {e}", now, stats)
                results.append(self._failed_output(state))
                continue
            if finished:
                state.metrics.finished_time = now
                reasons = {c.finish_reason for c in state.children.values()}
                reason = next(r for r in ("abort", "stop", "length") if r in reasons)
                self._finished(state, reason, now, stats)
                del self.requests[parent_id]
                for core_id in state.children:
                    self.child_to_parent.pop(core_id, None)
            if output is not None:
                results.append(output)
        return results, to_abort

    def _process_one(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        stats: IterationStats,
        now: float,
        to_abort: list[str],
    ) -> bool:
        """Apply one core output to its request's state; False if its child had finished
        already (nothing new). A stop string found here adds the child to to_abort."""
        child = state.children[out.request_id]
        if child.finish_reason is not None:
            return False
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.scheduled_time is not None and state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = out.scheduled_time
        if out.new_token_ids:
            stats.num_generation_tokens += len(out.new_token_ids)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                stats.num_prompt_tokens += len(state.prompt_token_ids)
                stats.num_computed_prompt_tokens += (
                    len(state.prompt_token_ids) - state.num_cached_tokens
                )
                stats.time_to_first_tokens.append(now - state.metrics.arrival_time)
            elif state.metrics.last_token_time is not None:
                stats.inter_token_latencies.append(now - state.metrics.last_token_time)
        state.metrics.last_token_time = now
        if out.num_preemptions:
            child.num_preemptions = out.num_preemptions
        child.token_ids += out.new_token_ids
        if out.logprobs is not None and child.logprobs is not None:
            for position in out.logprobs:
                child.logprobs.append(self._position(*position))
                child.cumulative_logprob += position[0][0]
        if out.pooled is not None:
            state.pooled = out.pooled
        if out.kv_transfer_params is not None and child.index == 0:
            state.kv_transfer_params = out.kv_transfer_params
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            values, token_ids, ranks = (a.tolist() for a in out.prompt_logprobs)
            state.prompt_logprobs = [None] + [
                self._position(*position) for position in zip(values, token_ids, ranks, strict=True)
            ]
        child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        if child.detokenizer is not None:
            stop = child.detokenizer.update(out.new_token_ids)
            unread = len(out.new_token_ids) - child.detokenizer.num_consumed
            if unread:  # accepted drafts past a stop string are not output
                del child.token_ids[-unread:]
                if out.logprobs is not None and child.logprobs is not None:
                    for position in child.logprobs[-unread:]:  # the chosen token first
                        child.cumulative_logprob -= next(iter(position.values())).logprob
                    del child.logprobs[-unread:]
            if stop is not None and out.finish_reason is None:
                child.finish_reason, child.stop_reason = "stop", stop
                to_abort.append(out.request_id)
            elif stop is not None:  # finished in the core this very step anyway
                child.finish_reason, child.stop_reason = "stop", stop
        return True

    def _fail(
        self, state: RequestState, message: str, now: float, stats: IterationStats
    ) -> list[str]:
        """End a failed request (counted in stats): every completion "error", the message its
        stop_reason; returns its core ids, to abort those still running."""
        for child in state.children.values():
            child.finish_reason, child.stop_reason = "error", message
        state.metrics.finished_time = now
        self._finished(state, "error", now, stats, error=message)
        del self.requests[state.request_id]
        for core_id in state.children:
            self.child_to_parent.pop(core_id, None)
        return list(state.children)

    def _finished(
        self,
        state: RequestState,
        reason: str,
        now: float,
        stats: IterationStats | None,
        error: str | None = None,
    ) -> None:
        """A request is over: count it in stats (when given) and send its span (with a
        tracer; a failing tracer is logged, never the request's failure)."""
        finished = _finished_stats(state, reason, now)
        if stats is not None:
            stats.finished.append(finished)
        if self.tracer is None:
            return
        children = sorted(state.children.values(), key=lambda c: c.index)
        try:
            self.tracer.record(
                state.request_id,
                state.params,
                state.metrics,
                num_prompt_tokens=finished.num_prompt_tokens,
                num_generation_tokens=finished.num_generation_tokens,
                finish_reasons=[c.finish_reason or reason for c in children],
                error=error,
                trace_headers=state.trace_headers,
                end_time=now,
            )
        except Exception:
            logger.exception("request %s: its span could not be recorded", state.request_id)

    @staticmethod
    def _failed_output(state: RequestState) -> RequestOutput:
        """A failed request's final output, built without its detokenizer (which may be
        what failed): no text, no tokens, each completion's error as its stop_reason."""
        completions = [
            CompletionOutput(c.index, "", [], None, None, c.finish_reason, c.stop_reason)
            for c in sorted(state.children.values(), key=lambda c: c.index)
        ]
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            None,
            completions,
            finished=True,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )

    def _position(self, values: list[float], token_ids: list[int], rank: int) -> PositionLogprobs:
        """{token id: Logprob} of one position: the chosen (or prompt) token, then the top-K."""
        entry = {}
        for j, (tid, lp) in enumerate(zip(token_ids, values, strict=True)):
            if tid in entry:
                continue  # the chosen token is also among the top-K
            decoded = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
            entry[tid] = Logprob(lp, rank if j == 0 else j, decoded)
        return entry

    def _make_output(self, state: RequestState, finished: bool, delta: bool) -> RequestOutput:
        completions = []
        for child in sorted(state.children.values(), key=lambda c: c.index):
            child_done = child.finish_reason is not None
            if delta and child.finish_sent:
                continue  # a DELTA stream gets each completion's end once
            text = (
                child.detokenizer.get_next_output_text(child_done, delta)
                if child.detokenizer is not None
                else ""
            )
            start = child.sent_tokens if delta else 0
            nothing_new = not text and not child_done and start == len(child.token_ids)
            if delta and len(state.children) > 1 and nothing_new:
                continue  # another completion's output: nothing new for this one
            child.sent_tokens = len(child.token_ids)
            child.finish_sent = child_done
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=child.token_ids[start:],
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=child.logprobs[start:] if child.logprobs is not None else None,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None  # a DELTA stream carries them in its first output only
        state.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            pooled=state.pooled,
            kv_transfer_params=state.kv_transfer_params,
        )
