"""Speculative decoding (vLLM V1's spec_decode/): proposers draft tokens after each step.

A proposer has `propose_rows(input_batch, rows, sample_rows) -> drafts per row` (sample_rows:
the sampling row of the step just verified that gave each row its latest token) and
`needs_kv_cache`; one that needs a KV cache (a draft model, an EAGLE head) also mirrors every
target forward (`mirror(t, forward_inputs, StepRows)`; draft_model.py, eagle.py).

The flow: a step's fetch gives each request's accepted tokens; the model runner asks the
proposer for the next drafts (`ModelRunnerOutput.spec_token_ids`); the scheduler keeps them on
the request and schedules them with its next token, within the token budget; the runner
scores every draft position in the same compiled step, samples each position as it would
without speculation and keeps the drafts up to the first one its sample disagrees with, plus
that sample (the rejection rule for drafts that are a single token each, which is exact: see
worker/model_runner.py); the scheduler rolls num_computed_tokens back over the rest.
"""

from jaxserve.spec_decode.draft_model import DraftModelProposer
from jaxserve.spec_decode.eagle import EagleProposer, StepRows
from jaxserve.spec_decode.ngram_proposer import NgramProposer

__all__ = ["DraftModelProposer", "EagleProposer", "NgramProposer", "StepRows"]
