"""A decode step's forward and sampling as one executable (step_functions.forward_sample):
the device runs the step's programs back to back with no idle gap between them, and the host
launches one executable instead of two.

Which shapes: for each forward a decode step runs (the decode-only forwards where the
attention backend has them, else the general forwards up to max_num_seqs' token bucket), the
sample bucket a decode step of that many tokens has, with each of FUSED_VARIANTS (the
samplers of the common requests: all greedy, and temperature sampling with or without
greedy rows). A step runs its fused executable when one of that shape is ready and covers
its sampler, and nothing waits between its forward and its sampling: no grammar bitmask or
bad words (the host computes those while the forward runs: worker/model_runner.py
dispatch_sample), no prompt logprobs; else the forward and the sampling run as two
executables, as before.

When: JAXSERVE_FUSED_SAMPLING, "auto" by default: with the Pallas attention backend (a GPU,
where the gap between executables is device idle time), not on CPU, where one more forward
per bucket costs start-up time for no measured gain. Never with speculative decoding (the
proposer reads the forward's outputs between the two) or pipeline stages. The fused
executables compile after the shapes that serve any step (in the background with a
background start-up); with JAXSERVE_MINIMAL_COMPILE only when JAXSERVE_FUSED_SAMPLING is "1".
"""

from __future__ import annotations

from typing import Any

from jaxserve import envs
from jaxserve.layers.sampler import SamplerVariant
from jaxserve.worker.buckets import BucketTable

FUSED_VARIANTS = (SamplerVariant(), SamplerVariant(random=True, greedy=True))
NAME = "forward_sample"  # the executables' names: (NAME, t, decode_only, variant)


def enabled(attention_backend: str, *, one_stage: bool, drafts: bool, minimal: bool) -> bool:
    """Whether a runner compiles and runs fused steps (see the module docstring)."""
    setting = envs.JAXSERVE_FUSED_SAMPLING
    if setting == "0" or not one_stage or drafts:
        return False
    if setting == "1":
        return True
    return attention_backend == "pallas" and not minimal


def decode_shapes(
    buckets: BucketTable, forward_variants: list[tuple[int, bool]]
) -> dict[tuple[int, bool], int]:
    """(token bucket, decode_only) of each forward a decode step runs -> the sample bucket of
    a decode step that fills it (a step of n tokens, one row each: S = sample(n))."""
    decode_only = any(d for _, d in forward_variants)
    return {
        (t, d): buckets.sample(min(t, buckets.max_sample_rows))
        for t, d in forward_variants
        if t <= buckets.decode_top and d == decode_only
    }


class FusedSampling:
    """A runner's fused steps: their shapes, and which one a dispatched step runs."""

    def __init__(self, shapes: dict[tuple[int, bool], int]):
        self.shapes = shapes  # (t, decode_only) -> sample bucket

    def names(self) -> list[tuple]:
        return [(NAME, t, d, v) for (t, d) in self.shapes for v in FUSED_VARIANTS]

    def pick(self, batch: Any, waits: bool, executables: Any) -> tuple | None:
        """The fused executable's name for a built step (worker/step_types.py StepBatch), or
        None: its shape has none, none ready covers its sampler, or the sampling waits
        (`waits`: a grammar bitmask or bad words) or the step wants prompt logprobs."""
        key = (batch.num_tokens, batch.forward.attn.decode_only)
        if waits or self.shapes.get(key) != batch.sample.rows.shape[0]:
            return None
        if batch.wants_prompt_lp.any():
            return None
        for variant in FUSED_VARIANTS:
            name = (NAME, *key, variant)
            if variant.covers(batch.needed) and name in executables:
                return name
        return None
