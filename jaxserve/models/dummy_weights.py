"""Random weights for `--load-format dummy` (models/loader.py): every parameter generated on
its devices in its sharding and dtype, packed formats included (random codes, scales that keep
activations O(1)), for timing shapes no bundled checkpoint has."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

DUMMY_STD = 0.02  # dummy weights ~ N(0, 0.02^2) (HF's initializer_range); norm weights are 1


def dummy_params(
    targets: dict[tuple, Any], shardings: dict[tuple, Any], seed: int = 0
) -> dict[tuple, jax.Array]:
    """Random parameters, each generated straight into its sharding and dtype by a jitted
    program (nothing is built on the host, so an 8B model costs no host memory). One program
    per kind of parameter (shape, dtype, sharding), each run per parameter with its own key:
    one program for all of them held every parameter's random bits at once (26 GB for two of
    DeepSeek-V3's layers)."""
    programs: dict[tuple, Any] = {}
    key = jax.random.key(seed)
    out = {}
    for i, p in enumerate(targets):
        shape, dtype = tuple(targets[p].shape), jnp.dtype(targets[p].dtype)
        kind = _dummy_kind(p, targets[p])
        signature = (shape, dtype, shardings[p], kind)
        if signature not in programs:
            make = functools.partial(_dummy_value, shape=shape, dtype=dtype, kind=kind)
            programs[signature] = jax.jit(make, out_shardings=shardings[p])
        out[p] = programs[signature](jax.random.fold_in(key, i))
    return out


def _dummy_kind(path: tuple, target) -> str:
    """How a dummy parameter is filled (`_dummy_value`)."""
    dtype = jnp.dtype(target.dtype)
    if "norm" in "/".join(map(str, path)):
        return "ones"  # RMSNorm weights: 1, activations stay O(1)
    leaf = str(path[-1]).split("_")[-1]  # packed experts: w13_scale, w2_offset
    if leaf in ("scale", "offset", "perm"):
        return "e8m0" if leaf == "scale" and dtype == jnp.dtype(jnp.uint8) else leaf
    if dtype == jnp.dtype(jnp.uint8):
        return "bits"  # int4: two random nibbles a byte
    return "quantized" if quantized_dtype(target) else "normal"


def _dummy_value(key, *, shape: tuple, dtype, kind: str) -> jax.Array:
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "e8m0":  # mxfp4's exponents
        return jnp.full(shape, 127 + round(math.log2(DUMMY_STD / 3)), dtype)
    if kind == "scale":  # of a quantized kernel holding ~N(0, 32) values
        return jnp.full(shape, DUMMY_STD / 32, dtype)
    if kind == "offset":  # of a gguf or int4 kernel
        return jnp.zeros(shape, dtype)
    if kind == "perm":  # of an act-order int4 kernel: the identity
        return jnp.arange(shape[0], dtype=dtype)
    if kind == "bits":
        return jax.random.bits(key, shape, dtype)
    if kind == "quantized":
        w = jax.random.normal(key, shape) * 32
        return jnp.clip(jnp.round(w), -127, 127).astype(dtype)
    return (jax.random.normal(key, shape, dtype) * DUMMY_STD).astype(dtype)


def quantized_dtype(target) -> bool:
    """Whether a parameter holds quantized values (int8, e4m3 or packed uint8 codes)."""
    return jnp.dtype(target.dtype) in (
        jnp.dtype(jnp.int8),
        jnp.dtype(jnp.float8_e4m3fn),
        jnp.dtype(jnp.uint8),
    )
