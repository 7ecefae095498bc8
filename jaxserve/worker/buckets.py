"""The step shapes: every array a step hands the devices is padded to one of a few sizes
(buckets), each compiled at start-up, so serving never compiles.

  token buckets   T: a step's flat tokens, 1, 2, 4, .. max_num_batched_tokens
  sequence buckets: the forward's sequence rows at T, min(T, max_num_seqs) rounded up
  sample buckets  S: the sampling rows, 1, 2, 4, .. max_sample_rows (one per request, plus
                  one per draft token with speculative decoding)

With k draft tokens, 1 + k is a token and a sample bucket too: one request's decode with its
drafts then fills its buckets exactly.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

MIN_BUCKET = 1


def power_of_two_buckets(smallest: int, largest: int) -> list[int]:
    """smallest, 2*smallest, ... up to and always including largest."""
    buckets, b = [], min(smallest, largest)
    while b < largest:
        buckets.append(b)
        b *= 2
    return [*buckets, largest]


def bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest of the ascending `buckets` holding n (ValueError past the largest)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} is over the largest bucket, {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass(frozen=True)
class BucketTable:
    """The buckets of one runner (see the module docstring)."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    samples: tuple[int, ...]
    max_num_seqs: int
    max_sample_rows: int

    @classmethod
    def build(
        cls,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_spec_tokens: int = 0,
        coarse: bool = False,
    ) -> BucketTable:
        """num_spec_tokens: k, the draft tokens a request may run after its last token.
        coarse: only the buckets a step cannot do without (envs.JAXSERVE_MINIMAL_COMPILE):
        tokens max_num_seqs' bucket and the largest, samples the largest (and 1 + k with
        drafts), each step padded up to them."""
        max_sample_rows = max_num_seqs  # one per request, plus one per draft token
        if num_spec_tokens:
            max_sample_rows = min(
                max_num_seqs * (1 + num_spec_tokens), max(max_num_seqs, max_num_batched_tokens)
            )
        tokens = power_of_two_buckets(MIN_BUCKET, max_num_batched_tokens)
        samples = power_of_two_buckets(MIN_BUCKET, max_sample_rows)
        if num_spec_tokens:  # one request's decode with k drafts fills its buckets exactly
            width = 1 + num_spec_tokens
            if width < tokens[-1]:
                tokens = sorted({*tokens, width})
            if width < samples[-1]:
                samples = sorted({*samples, width})
        seqs = power_of_two_buckets(MIN_BUCKET, max_num_seqs)
        if coarse:
            drafts = {1 + num_spec_tokens} if num_spec_tokens else set()
            decode = bucket(tokens, min(max_num_seqs, tokens[-1]))
            tokens = [t for t in tokens if t in {decode, tokens[-1], *drafts}]
            samples = [s for s in samples if s in {samples[-1], *drafts}]
            seqs = sorted({bucket(seqs, min(t, max_num_seqs)) for t in tokens})
        return cls(tuple(tokens), tuple(seqs), tuple(samples), max_num_seqs, max_sample_rows)

    def token(self, num_tokens: int) -> int:
        return bucket(self.tokens, num_tokens)

    def seq(self, num_seqs: int) -> int:
        return bucket(self.seqs, num_seqs)

    def sample(self, num_rows: int) -> int:
        return bucket(self.samples, num_rows)

    def forward_seqs(self, t: int) -> int:
        """Sequence rows of the forward's metadata at token bucket t: every sequence has at
        least one token, so min(t, max_num_seqs) rounded up to a sequence bucket."""
        return self.seq(min(t, self.max_num_seqs))

    @property
    def decode_top(self) -> int:
        """The token bucket of the largest decode step (max_num_seqs tokens, one each)."""
        return self.token(min(self.max_num_seqs, self.tokens[-1]))

    def forward_variants(self, decode_only_forwards: bool) -> list[tuple[int, bool]]:
        """(token bucket, decode_only) of every forward: a general one per bucket and, where
        the attention backend has them (decode_only_forwards), a decode-only one per bucket a
        decode step can fall in (it has at most max_num_seqs tokens); a 1-token step is
        always a decode."""
        if not decode_only_forwards:
            return [(t, False) for t in self.tokens]
        decode = [(t, True) for t in self.tokens if t <= self.decode_top]
        return decode + [(t, False) for t in self.tokens if t > 1]
