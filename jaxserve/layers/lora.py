"""LoRA adapters in device slots: each targeted projection holds every slot's A and B, and
each token of a step picks its slot (or none).

A projection y = x @ W of a token whose request runs adapter slot s becomes
y + (x @ A[s]) @ B[s], with the adapter's scaling (alpha / r, or alpha / sqrt(r) with
rsLoRA) folded into B when it is loaded (models/lora.py). The product runs over every slot at
once and a one-hot mask per token keeps its own slot's columns: x [T, in] @ A [S, in, P]
-> [T, S, P], masked, then contracted with B [S, P, out] over (S, P). Shapes never change
(S = --max-loras slots, P = the projection's parts x --max-lora-rank, zero-padded), so
loading another adapter is a copy into a slot and never a compilation.

A step with no adapter tokens skips both products at run time (`lax.cond`, one compiled
step for both cases) where `skip_idle` is set: on CPU. On a GPU, XLA runs a conditional by
reading its predicate back to the host, a sync per projection (4 per layer), so there the
products always run: a token without an adapter has an all-zero mask row, and the cost is
reading the S slots' A and B (S * P * (in + out) values per projection) each step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


class LoRABatch(NamedTuple):
    """Which adapter slot each token of a step uses."""

    mask: jax.Array  # [T, S] one-hot in the activations' dtype; a row of zeros: no adapter
    active: jax.Array  # bool[]: some token uses an adapter (else the products are skipped)

    @classmethod
    def from_slots(cls, slots: jax.Array, num_slots: int, dtype) -> LoRABatch:
        """slots: i32[T], each token's slot (-1: none)."""
        mask = (slots[:, None] == jnp.arange(num_slots)[None, :]).astype(dtype)
        return cls(mask, jnp.any(slots >= 0))


class LoRAWeights(nnx.Module):
    """One projection's slots: a [S, in, P] and b [S, P, out] (zero where no adapter is)."""

    def __init__(self, a: jax.Array, b: jax.Array, skip_idle: bool = True):
        self.a = nnx.Param(a)
        self.b = nnx.Param(b)
        self.skip_idle = skip_idle  # a step without adapter tokens skips the products

    def __call__(self, x: jax.Array, y: jax.Array, lora: LoRABatch) -> jax.Array:
        """x [T, in] (the projection's input), y [T, out] (its output) -> y with each
        token's adapter delta added."""

        def add_delta(y: jax.Array) -> jax.Array:
            u = jnp.einsum("ti,sip->tsp", x, self.a[...].astype(x.dtype))
            u = u * lora.mask[:, :, None].astype(u.dtype)
            delta = jnp.einsum("tsp,spo->to", u, self.b[...].astype(x.dtype))
            return y + delta.astype(y.dtype)

        if not self.skip_idle:
            return add_delta(y)
        return lax.cond(lora.active, add_delta, lambda y: y, y)
