"""The grouped matmul on CPU: a loop over tiles of rows, each tile one dot with its group's
weights (XLA:CPU lowers ragged_dot by padding it to a dense batched dot: every row times every
group's weights, G times the work and a [G, N, F] temporary: 26 GB for two of DeepSeek-V3's
layers at a 2,048-token step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import cpu_packed
from pallas_kernels.grouped_matmul.packed import Packed

# Rows per tile: at decode each tile holds a row or two, at prefill a tile's dot is big enough
# to run well.
TILE_ROWS = 16


def tiled(x: jax.Array, w: jax.Array | Packed, group_sizes: jax.Array) -> jax.Array:
    """x [N, K], w [G, K, F] (or packed), group_sizes i32[G] -> [N, F]: each group's rows
    TILE_ROWS at a time (a loop over at most N / TILE_ROWS + G tiles), rows past the groups
    zero. Packed weights go to the C++ kernel (cpu_packed.py) where it runs, which decodes
    each routed expert once; elsewhere one tile's expert at a time, inside the loop."""
    if isinstance(w, Packed) and cpu_packed.runs(x, w):
        return cpu_packed.packed_matmul_cpu(x, w, group_sizes)
    n, t, (g, _, f) = x.shape[0], TILE_ROWS, w.shape
    ends = jnp.cumsum(group_sizes)
    tiles = (group_sizes + t - 1) // t  # [G]
    tile_ends = jnp.cumsum(tiles)
    ids = jnp.arange(-(-n // t) + g, dtype=jnp.int32)  # a static bound on the tiles
    group = jnp.minimum(jnp.searchsorted(tile_ends, ids, side="right"), g - 1)
    first = ends[group] - group_sizes[group] + (ids - tile_ends[group] + tiles[group]) * t
    xp = jnp.pad(x, ((0, t), (0, 0)))

    def tile(i, out):
        e, start = group[i], first[i]
        we = w.expert(e, x.dtype) if isinstance(w, Packed) else w[e]
        y = jax.lax.dynamic_slice_in_dim(xp, start, t) @ we
        keep = (start + jnp.arange(t) < ends[e])[:, None]
        old = jax.lax.dynamic_slice_in_dim(out, start, t)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), start, 0)

    out = jax.lax.fori_loop(0, tile_ends[-1], tile, jnp.zeros((n + t, f), x.dtype))
    return out[:n]
