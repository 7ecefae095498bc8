"""The one structure a model's forward takes (besides its KV caches): the step's tokens and
every optional feature's fields, None where the step has none. The model runner builds it on
the host (worker/batch_builder.py and each feature's `forward_inputs`); every family's
`__call__(inputs, kv_caches, ...)` reads what it supports.

Shapes: T tokens of the step (its token bucket), R its sampling rows, C encoder-cache rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxserve.layers.attention import AttentionMetadata


class StepInputs(NamedTuple):
    """A step's T tokens (padded) of up to R sequences."""

    input_ids: np.ndarray  # i32[T]; -1: take the row's last sampled token on the device
    positions: np.ndarray  # i32[T]
    token_rows: np.ndarray | None  # i32[T]: each token's input-batch row (a hybrid's states)
    attn: AttentionMetadata
    logits_indices: np.ndarray | None = None  # i32[R]: each sampling row's token (the runner's)
    lora_slots: np.ndarray | None = None  # i32[T]: each token's LoRA slot (-1: none); LoRA on
    # A multimodal model's (worker/encoder_runner.py): each token's encoder-cache row (-1:
    # text), the encoder cache [C, D] on the device, and M-RoPE's i32[3, T] positions
    mm_rows: np.ndarray | None = None
    mm_embeds: jax.Array | None = None
    mrope_positions: np.ndarray | None = None
    # A pipeline stage after the first (worker/pipeline_stages.py): the stage before's
    # hidden states [T, D], in place of the embedding
    hidden_in: jax.Array | None = None


def text_inputs(input_ids, positions, attn: AttentionMetadata, token_rows=None) -> StepInputs:
    """A step of tokens alone (a draft model's, a test's)."""
    return StepInputs(input_ids, positions, token_rows, attn)
