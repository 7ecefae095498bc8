"""Rotary position embeddings (HF's rotate-half layout) with linear and llama3 scaling."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], float32, after the configured scaling."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rotary(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x: [T, H, D] by angles positions [T] x inv_freq [D // 2]; float32 math."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
