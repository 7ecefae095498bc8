"""The scheduler's gates beside its phases: structured-output grammars that must compile
before a request runs (`GrammarGate`), and images whose encoder outputs must be computed
before their placeholder tokens run (`EncoderGate`, over core/encoder_cache_manager.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxserve.core.encoder_cache_manager import EncoderCacheManager


class GrammarGate:
    """Scheduler methods for requests whose grammar compiles (WAITING_FOR_FSM)."""

    def _grammar_compiled(self, request: Request) -> bool:
        """A WAITING_FOR_FSM request whose compile is done: True if it may be scheduled; a
        failed compile finishes it (an error, reported with the next outputs)."""
        so = request.structured_output_request
        if so.future.exception() is not None:
            self.pending_outputs.append(self._fail(request, so.future.exception()))
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


class EncoderGate:
    """Scheduler methods for a multimodal model's images (`encoder_cache` None: none)."""

    encoder_cache: EncoderCacheManager | None

    def _plan_encoder(self, request: Request, start: int, num_new: int) -> tuple[int, list]:
        """(the request's tokens from `start` that may run, its images to compute first)."""
        if self.encoder_cache is None or not request.mm_features:
            return num_new, []
        return self.encoder_cache.plan(request, start, num_new)

    def _commit_encoder(self, request: Request, start: int, num_new: int, work: list) -> None:
        if self.encoder_cache is not None and request.mm_features:
            self.encoder_cache.commit(request, start, num_new, work)

    def _trim_hit(self, request: Request, blocks: list, num_computed: int) -> tuple[list, int]:
        """A prefix-cache hit that would end inside a bidirectional image ends at the block
        before it instead (the image's tokens must run in one step)."""
        ec = self.encoder_cache
        if ec is None or not ec.bidirectional or not request.mm_features:
            return blocks, num_computed
        for f in request.mm_features:
            if f.offset < num_computed < f.end:
                keep = f.offset // request.block_size
                return blocks[:keep], keep * request.block_size
        return blocks, num_computed

    def _take_encoder_inputs(self) -> dict[str, list[int]]:
        return {} if self.encoder_cache is None else self.encoder_cache.end_step()

    def _encoder_rows(self, request: Request, num_new: int, into: dict) -> None:
        """The rows of the images the request's scheduled tokens read (into `into`), and
        let go of those it has then run all of."""
        ec = self.encoder_cache
        if ec is None or not request.mm_features:
            return
        for f in ec.overlapping(request, request.num_computed_tokens, num_new):
            into[f.identifier] = ec.rows(f.identifier)
        ec.done_with(request, request.num_computed_tokens + num_new)
