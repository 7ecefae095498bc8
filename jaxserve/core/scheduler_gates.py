"""The scheduler's gates beside its phases, each an object that owns its state: images whose
encoder outputs must be computed before their placeholder tokens run (`EncoderGate`, over
core/encoder_cache_manager.py; `NoEncoderGate` for a text-only model), and structured-output
grammars that must compile before a request runs (`GrammarGate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.request import Request

if TYPE_CHECKING:
    from jaxserve.core.encoder_cache_manager import EncoderCacheManager
    from jaxserve.structured_output import StructuredOutputManager


class EncoderGate:
    """A multimodal model's images in the scheduler's step."""

    def __init__(self, cache: EncoderCacheManager):
        self.cache = cache

    def begin_step(self) -> None:
        self.cache.begin_step()

    def plan(self, request: Request, start: int, num_new: int) -> tuple[int, list]:
        """(the request's tokens from `start` that may run, its images to compute first)."""
        if not request.mm_features:
            return num_new, []
        return self.cache.plan(request, start, num_new)

    def commit(self, request: Request, start: int, num_new: int, work: list) -> None:
        if request.mm_features:
            self.cache.commit(request, start, num_new, work)

    def trim_hit(self, request: Request, num_computed: int) -> int:
        """A prefix-cache hit (num_computed tokens, whole blocks) that would end inside a
        bidirectional image ends at the block before it instead (the image's tokens must
        run in one step); the KV manager looks the hit up again below it."""
        if not self.cache.bidirectional or not request.mm_features:
            return num_computed
        for f in request.mm_features:
            if f.offset < num_computed < f.end:
                return f.offset // request.block_size * request.block_size
        return num_computed

    def take_inputs(self) -> dict:
        """The step's SchedulerOutput fields: its encoder work (request id -> feature
        indices)."""
        return {"scheduled_encoder_inputs": self.cache.end_step()}

    def rows(self, request: Request, num_new: int, into: dict) -> None:
        """The rows of the images the request's scheduled tokens read (into `into`), and
        let go of those it has then run all of."""
        if not request.mm_features:
            return
        ec = self.cache
        for f in ec.overlapping(request, request.num_computed_tokens, num_new):
            into[f.identifier] = ec.rows(f.identifier)
        ec.done_with(request, request.num_computed_tokens + num_new)

    def release(self, request: Request) -> None:
        self.cache.release(request)


class NoEncoderGate(EncoderGate):
    """A text-only model's: no image ever waits."""

    def __init__(self):
        pass

    def begin_step(self) -> None:
        pass

    def plan(self, request: Request, start: int, num_new: int) -> tuple[int, list]:
        return num_new, []

    def commit(self, request: Request, start: int, num_new: int, work: list) -> None:
        pass

    def trim_hit(self, request: Request, num_computed: int) -> int:
        return num_computed

    def take_inputs(self) -> dict:
        return {}

    def rows(self, request: Request, num_new: int, into: dict) -> None:
        pass

    def release(self, request: Request) -> None:
        pass


class GrammarGate:
    """Requests whose grammar compiles (WAITING_FOR_FSM) before they may run."""

    def __init__(self, manager: StructuredOutputManager | None):
        self.manager = manager

    def start(self, request: Request) -> None:
        """Start compiling the request's grammar (ValueError: no backend, a bad grammar)."""
        if self.manager is None:
            raise ValueError("this engine has no structured-output backend")
        self.manager.grammar_init(request)

    def error(self, request: Request) -> BaseException | None:
        """The compile's exception (the request then fails), None once it compiled."""
        return request.structured_output_request.future.exception()

    def bitmask(self, requests: list, first_rows, drafts, num_rows: int):
        """The step's token bitmask, i32[num_rows, ceil(V/32)] (one row per sampling row: a
        request's first_rows[i], then one per draft), or None when no request whose token the
        step keeps is constrained (requests: None where the step keeps no token; see
        StructuredOutputManager.grammar_bitmask)."""
        if self.manager is None:
            return None
        return self.manager.grammar_bitmask(requests, first_rows, drafts, num_rows)
