"""Structured outputs (vLLM V1's `structured_output/`): constrained decoding in the engine core.

  1. The frontend checks the constraint (`validate_structured_outputs`): a bad schema, regex
     or grammar is a 400 before anything is queued.
  2. `StructuredOutputManager.grammar_init` compiles it in a worker thread; the request waits
     (RequestStatus.WAITING_FOR_FSM) and the scheduler skips it until the grammar is ready.
  3. Each step, once every earlier step's tokens are known, `grammar_bitmask` fills one row of
     allowed tokens (i32[S, ceil(V/32)]) per constrained request; the model runner hands it to
     the compiled sampling step, which masks the logits (a fixed-shape input: constrained and
     free requests share one batch, nothing recompiles).
  4. The scheduler advances the request's grammar with every kept token and stops it when the
     grammar is complete.
With a reasoning parser, a request is constrained only after its reasoning ends (as vLLM).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.structured_output.backend_guidance import (
    GuidanceBackend,
    GuidanceGrammar,
    validate_structured_outputs,
)

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ConstrainedRequest",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "bitmask_words",
    "validate_structured_outputs",
]


REASONING_TAIL = 16  # latest output tokens searched for the end of the reasoning


def bitmask_words(vocab_size: int) -> int:
    """Width of a bitmask row: 32 tokens per int32 word."""
    return -(-vocab_size // 32)


class StructuredOutputRequest:
    """A request's constraint and its grammar, compiled in the background."""

    def __init__(self, params: StructuredOutputsParams, future: Future):
        self.params = params
        self.future = future
        self.reasoning_ended = True  # False while a reasoning parser sees it thinking

    @property
    def is_ready(self) -> bool:
        return self.future.done()

    @property
    def grammar(self) -> GuidanceGrammar:
        return self.future.result()  # raises the compile error, if any


class ConstrainedRequest(Protocol):
    """What the manager reads and sets on an engine request (core/request.py's Request, a
    floor above this package, which it therefore does not import)."""

    request_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int]
    structured_output_request: StructuredOutputRequest | None


class StructuredOutputManager:
    """Compiles grammars off the engine loop and builds each step's token bitmask."""

    def __init__(self, config: EngineConfig, max_workers: int = 2):
        self.config = config
        self.vocab_size = config.model.vocab_size
        self.pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._backend: GuidanceBackend | None = None
        self._backend_lock = threading.Lock()
        self._compiling: list[Future] = []
        # The step profile's structured-output cost: host time building bitmasks, and steps.
        self.bitmask_seconds = 0.0
        self.bitmask_steps = 0
        self.reasoner = None
        if config.reasoning_parser:
            from jaxserve.reasoning import ReasoningParserManager

            parser_cls = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
            self.reasoner = parser_cls(self._tokenizer())

    def _tokenizer(self):
        from jaxserve.transformers_utils.tokenizer import read_tokenizer

        tokenizer = read_tokenizer(self.config.tokenizer_path or self.config.model_path)
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; it has none")
        return tokenizer

    @property
    def backend(self) -> GuidanceBackend:
        """Built on first use (the first constrained request), in a grammar thread."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = GuidanceBackend(self._tokenizer(), self.vocab_size)
            return self._backend

    def grammar_init(self, request: ConstrainedRequest) -> None:
        params = request.sampling_params.structured_outputs
        future = self.pool.submit(lambda: self.backend.compile_grammar(params))
        self._compiling = [f for f in self._compiling if not f.done()] + [future]
        request.structured_output_request = StructuredOutputRequest(params, future)
        if self.reasoner is not None:
            request.structured_output_request.reasoning_ended = False

    def should_advance(self, request: ConstrainedRequest) -> bool:
        """Whether the request's new tokens go through its grammar: it is constrained and
        its reasoning (if a reasoning parser is set) has ended. Tracks the reasoning's end."""
        so = request.structured_output_request
        if so is None:
            return False
        if not so.reasoning_ended:
            # Checked at every token, so the tag is always within the latest few: a tail
            # keeps this O(1) per token (without a `</think>` id the parser decodes them).
            if self.reasoner.is_reasoning_end(request.output_token_ids[-REASONING_TAIL:]):
                so.reasoning_ended = True
            return False  # the token that ends the reasoning is not the grammar's
        return True

    def advance(self, request: ConstrainedRequest, token: int) -> bool:
        """Feed a kept token to the request's grammar (when should_advance); True when the
        grammar is complete (or broken: a token it did not allow, e.g. min_tokens blocking the
        EOS it demanded)."""
        if not self.should_advance(request):
            return False
        grammar = request.structured_output_request.grammar
        if not grammar.accept_tokens([token]):
            logger.warning("request %s: token %d breaks its grammar", request.request_id, token)
            return True
        return grammar.is_terminated()

    def grammar_bitmask(
        self,
        requests: list[ConstrainedRequest | None],
        first_rows: list[int],
        drafts: list[list[int]],
        num_rows: int,
    ) -> np.ndarray | None:
        """i32[num_rows, ceil(V/32)]: requests[i]'s rows from first_rows[i] on, one before and
        one after each of its drafts[i] (speculative decoding), the allowed tokens there (all
        allowed for None, unconstrained or still-reasoning requests, and after a draft the
        grammar refuses); None when no row is constrained."""
        rows = [
            (r.structured_output_request.grammar, first, d)
            for r, first, d in zip(requests, first_rows, drafts, strict=True)
            if r is not None
            and r.structured_output_request is not None
            and r.structured_output_request.reasoning_ended
        ]
        if not rows:
            return None
        start = time.perf_counter()
        bitmask = np.full((num_rows, bitmask_words(self.vocab_size)), -1, np.int32)
        self.backend.fill_bitmask(rows, bitmask)
        self.bitmask_seconds += time.perf_counter() - start
        self.bitmask_steps += 1
        return bitmask

    def valid_drafts(self, request: ConstrainedRequest, drafts: list[int]) -> list[int]:
        """The prefix of a request's next drafts its grammar accepts: all of them when it is
        unconstrained, none while its reasoning (before the grammar binds) goes on."""
        so = request.structured_output_request
        if so is None or not drafts:
            return drafts
        if not so.reasoning_ended:
            return []
        return drafts[: so.grammar.validate_tokens(drafts)]

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to timeout seconds for any grammar being compiled to finish."""
        futures = [f for f in self._compiling if not f.done()]
        self._compiling = futures
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)
