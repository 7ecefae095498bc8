"""Rotary position embeddings (HF's rotate-half layout) with linear, llama3 and YaRN scaling,
and Gemma 4's proportional rotary."""

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
        # equal factors (Llama 4 Scout's) leave no medium band: its NaNs are never selected
        with np.errstate(divide="ignore", invalid="ignore"):
            smooth = (old_len / wavelen - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, rope)
    elif rope.rope_type == "proportional":  # the leading pairs turn, the rest stay
        turned = int(rope.proportion * head_dim // 2)
        inv_freq = np.where(np.arange(head_dim // 2) < turned, inv_freq, 0.0) / rope.factor
    return inv_freq.astype(np.float32)


def rope_attention_factor(rope: RopeConfig) -> float:
    """The scale of cos and sin: 1, or YaRN's attention factor (0.1 ln(factor) + 1 unless the
    config gives it, or mscale / mscale_all_dim say otherwise)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


def _yarn_inv_freq(dim: int, rope: RopeConfig) -> np.ndarray:
    """YaRN: interpolated (divided by factor) low frequencies, extrapolated (unchanged) high
    ones, and a linear ramp between the dimensions that turn beta_slow and beta_fast times
    over the original context."""

    def correction_dim(rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    return (1 / (rope.factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate


def apply_rotary(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
) -> jax.Array:
    """Rotate x: [T, H, D] by angles positions [T] x inv_freq [R // 2], cos and sin times
    scale (YaRN's attention factor); float32 math. With R < D (partial rotary) only the
    leading R dims of each head turn, the rest pass through."""
    rotary_dim = 2 * len(inv_freq)
    if rotary_dim < x.shape[-1]:
        turned = apply_rotary(x[..., :rotary_dim], positions, inv_freq, scale)
        return jnp.concatenate([turned, x[..., rotary_dim:]], axis=-1)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    return _rotate(x, freqs, scale)


def _rotate(x: jax.Array, freqs: jax.Array, scale: float) -> jax.Array:
    """x: [T, H, D] turned by angles freqs f32[T, D / 2] (rotate-half), cos and sin times
    scale; float32 math, x's dtype out."""
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def apply_mrope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: np.ndarray,
    mrope_section: tuple[int, ...],
    scale: float = 1.0,
    interleaved: bool = False,
) -> jax.Array:
    """Multimodal rotary (Qwen2-VL / Qwen2.5-VL M-RoPE): rotate x: [T, H, D] as `apply_rotary`
    does, but frequency f of inv_freq [R // 2] turns by the position of axis i % 3 (0:
    temporal, 1: height, 2: width) of positions i32[3, T], i the mrope_section chunk that f
    falls in (sum(mrope_section) == R // 2), as HF's Qwen2_5_VLRotaryEmbedding recomposes its
    cos and sin (the former apply_multimodal_rotary_pos_emb). interleaved (Qwen3.5, Qwen3-VL):
    frequency f turns by height when f % 3 == 1 and f < 3 * mrope_section[1], by width when
    f % 3 == 2 and f < 3 * mrope_section[2], else by time. Float32 math; with R < D only the
    leading R dims turn."""
    rotary_dim = 2 * len(inv_freq)
    if sum(mrope_section) != len(inv_freq):
        raise ValueError(f"mrope_section {mrope_section} does not sum to {len(inv_freq)}")
    if rotary_dim < x.shape[-1]:
        turned = apply_mrope(
            x[..., :rotary_dim], positions, inv_freq, mrope_section, scale, interleaved
        )
        return jnp.concatenate([turned, x[..., rotary_dim:]], axis=-1)
    if interleaved:
        f = np.arange(len(inv_freq))
        axis = np.where(
            (f % 3 == 1) & (f < 3 * mrope_section[1]),
            1,
            np.where((f % 3 == 2) & (f < 3 * mrope_section[2]), 2, 0),
        )
    else:
        axis = np.concatenate([np.full(s, i % 3) for i, s in enumerate(mrope_section)])
    pos = positions.astype(jnp.float32)[axis]  # [R / 2, T]: each frequency's axis
    return _rotate(x, pos.T * jnp.asarray(inv_freq)[None, :], scale)  # angles [T, R / 2]
