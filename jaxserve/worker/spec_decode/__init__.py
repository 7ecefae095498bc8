"""Speculative decoding (vLLM V1's spec_decode/, inside the worker as vLLM's V2 runner has
it): proposers draft tokens after each step.

The flow: a step's fetch gives each request's accepted tokens (drafting.py: the acceptance
rule); the proposer drafts the next tokens (`Proposer.propose_rows`, proposer.py: the
interface; ngram_proposer.py, draft_model.py, eagle.py, mtp.py), returned as
`ModelRunnerOutput.spec_token_ids`; the scheduler keeps them on the request and schedules
them with its next token, within the token budget; the runner scores every draft position in
the same compiled step and samples each as it would without speculation; the scheduler rolls
num_computed_tokens back over the rejected ones.
"""
