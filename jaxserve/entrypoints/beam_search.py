"""Beam search as vLLM's: a loop over the engine, not inside it (`LLM.beam_search`, and
`use_beam_search` on /v1/completions).

Each step runs every live beam (its prompt plus the tokens it has so far) as a request of one
token with the top 2 * beam_width logprobs; each beam grows into a candidate per returned
token, and each prompt keeps its beam_width best candidates. A candidate ending in EOS is
complete (unless ignore_eos) and leaves the search; so does one that reaches max_model_len.
The beams' requests share their prompt's full KV blocks through the prefix cache, so a step
computes only each beam's last, partly filled block.

Ranking, vLLM's (`get_beam_search_score`): cumulative logprob / length ** length_penalty,
where the length counts the prompt's tokens too (an EOS at the end is not counted). Among
the beams of one step, all of one length, this orders as the cumulative logprob does; it
matters when completed beams of different lengths are compared at the end (HF's
`length_penalty` divides by the generated length only: the two agree when every beam runs
to max_tokens, e.g. with ignore_eos).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from jaxserve.outputs import Logprob, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones; `logprobs` one dict per
    generated position (the top 2 * beam_width there); `text` the decoded tokens (all of
    them from LLM.beam_search, as vLLM's; the generated ones over HTTP)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's beam_width best sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's: cum_logprob / len(tokens) ** length_penalty, the prompt counted, a final EOS
    not."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length**length_penalty)


class BeamSearch:
    """The beams of several prompts: `step_prompts()`, run them one token each, `advance()`
    with their outputs; repeat until `done`; then `results()`."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: BeamSearchParams,
        eos_token_id: int | None,
        max_model_len: int,
    ):
        self.params, self.eos, self.max_model_len = params, eos_token_id, max_model_len
        self.beams = [[BeamSearchSequence(list(p), [], num_prompt_tokens=len(p))] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def sampling_params(self) -> SamplingParams:
        """One token with the top 2 * beam_width logprobs (raw: before temperature)."""
        p = self.params
        return SamplingParams(
            max_tokens=1,
            logprobs=2 * p.beam_width,
            temperature=p.temperature,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.beams)

    def step_prompts(self) -> list[list[int]]:
        """Every live beam's tokens, prompt by prompt."""
        return [beam.tokens for beams in self.beams for beam in beams]

    def advance(self, outputs: list[RequestOutput]) -> None:
        """outputs: one per step_prompts() entry, in order."""
        it = iter(outputs)
        width, key = self.params.beam_width, self._key
        for i, beams in enumerate(self.beams):
            candidates = []
            for beam in beams:
                (position,) = next(it).outputs[0].logprobs
                for token, lp in position.items():
                    grown = dataclasses.replace(
                        beam,
                        tokens=beam.tokens + [token],
                        logprobs=beam.logprobs + [position],
                        cum_logprob=beam.cum_logprob + lp.logprob,
                    )
                    if token == self.eos and not self.params.ignore_eos:
                        self.completed[i].append(dataclasses.replace(grown, finish_reason="stop"))
                    else:
                        candidates.append(grown)
            self.beams[i] = sorted(candidates, key=key, reverse=True)[:width]
            for beam in [b for b in self.beams[i] if len(b.tokens) >= self.max_model_len]:
                self.beams[i].remove(beam)  # no room for another token
                self.completed[i].append(dataclasses.replace(beam, finish_reason="length"))
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Each prompt's beam_width best, completed and live together, by vLLM's score.
        decode: tokens -> text (None: no text)."""
        outputs = []
        for completed, beams in zip(self.completed, self.beams, strict=True):
            live = [dataclasses.replace(b, finish_reason="length") for b in beams]
            best = sorted(completed + live, key=self._key, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.text = decode(beam.tokens) if decode is not None else None
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty
        )


def check_beam_width(params: BeamSearchParams, max_logprobs: int) -> None:
    """ValueError when a step's 2 * beam_width logprobs exceed the engine's max_logprobs."""
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(
            f"beam_width {params.beam_width} needs {2 * params.beam_width} logprobs a step, over "
            f"the engine's max_logprobs {max_logprobs} (--max-logprobs)"
        )


async def beam_search_async(
    search: BeamSearch,
    run_one: Callable[[list[int], SamplingParams, int], Awaitable[RequestOutput]],
) -> None:
    """Run `search` to its end; run_one(tokens, params, index) runs one beam's step (the
    step's beams run concurrently)."""
    while not search.done:
        prompts, params = search.step_prompts(), search.sampling_params
        search.advance(
            await asyncio.gather(*(run_one(t, params, i) for i, t in enumerate(prompts)))
        )
