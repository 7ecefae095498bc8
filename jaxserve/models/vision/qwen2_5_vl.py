"""Qwen2.5-VL's vision tower in Flax NNX, on fixed (bucketed) shapes.

HF's `Qwen2_5_VisionTransformerPretrainedModel` reorders an image's patches into windows of
`window_size` pixels (`window_index`, whole spatial-merge units of merge**2 patches at a time),
runs most blocks with attention inside each window (`cu_window_seqlens`) and the
`fullatt_block_indexes` blocks over each whole frame (`cu_seqlens`), merges each unit's patches
(`merger`) and undoes the window order. Here the host (`prepare`, numpy) does every
data-dependent step: it permutes the patches and their (h, w) rotary positions into window
order, pads them to a bucket of N patches, and gives each patch a window and a frame segment
id; the device attends each query to the keys of its own segment (padding: segment -1, which
real patches never see) and gathers the merged rows back with `reverse_index`.

Window segments are contiguous runs of at most (window_size // merge // patch_size * merge)**2
patches, so window attention reads, for each block of queries, only a fixed slice of keys
around it: its cost grows as N, not N**2. Full attention runs in blocks of queries over all N keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.linear import Linear
from jaxserve.layers.norm import RMSNorm
from jaxserve.models.llama import HFWeight
from jaxserve.models.vision.vit import ACTIVATIONS, check_activation, fuse_heads

# transformers 5.23's Qwen2_5_VLVisionConfig defaults (rope_theta: the axial rope's default)
VISION_DEFAULTS: dict = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 4,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": (7, 15, 23, 31),
    "rope_theta": 10000.0,
}
HF_PREFIX = "visual."  # Qwen2_5_VLForConditionalGeneration.save_pretrained's vision tensors
NORM_EPS = 1e-6  # HF hard-codes the vision RMSNorms' eps
QUERY_BLOCK = 512  # queries per attention block (scores [H, QUERY_BLOCK, keys] at a time)
MIN_BUCKET_UNITS = 16  # the smallest patch bucket holds 16 merged tokens


def vision_config(config: dict) -> dict:
    """A full HF Qwen2.5-VL config dict (or its vision_config alone) -> the vision fields, HF's
    class defaults filling the missing ones (and hub configs' `in_chans` read as in_channels)."""
    if "vision_config" in config:
        raw = dict(config["vision_config"] or {})
    elif "depth" in config or str(config.get("model_type", "")).endswith("_vision"):
        raw = dict(config)
    else:
        raw = {}
    if "in_chans" in raw and "in_channels" not in raw:
        raw["in_channels"] = raw["in_chans"]
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    raw.setdefault("rope_theta", rope.get("rope_theta", VISION_DEFAULTS["rope_theta"]))
    out = {k: raw[k] if raw.get(k) is not None else v for k, v in VISION_DEFAULTS.items()}
    out["fullatt_block_indexes"] = tuple(int(i) for i in out["fullatt_block_indexes"])
    return out


def window_order(grid_thw: np.ndarray, vc: dict) -> tuple[np.ndarray, np.ndarray]:
    """HF's `get_vision_window_index`: grids i64[num_images, 3] -> (window_index i64[U]: the
    merge units in window order, window_units i64[num_windows]: the units of each non-empty
    window, in that order). U = sum(t * h * w) / merge**2."""
    m = vc["spatial_merge_size"]
    win = vc["window_size"] // m // vc["patch_size"]  # merged tokens per window side
    index, lengths, base = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        idx = np.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = win - gh % win, win - gw % win  # as HF: a whole empty window if 0
        nh, nw = (gh + pad_h) // win, (gw + pad_w) // win
        padded = np.pad(idx, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        padded = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, win * win)
        counts = (padded != -100).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        index.append(flat[flat != -100] + base)
        lengths.append(counts[counts > 0])
        base += t * gh * gw
    return np.concatenate(index), np.concatenate(lengths)


def checked_patches(
    pixel_values: np.ndarray, image_grid_thw: np.ndarray, num_patches: int, unit: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(grids i64[n, 3], pixels f32[P, ...], P) of one prepare call; ValueError unless the
    pixels are the grids' P patches and the bucket num_patches holds them in whole units of
    merge**2 patches."""
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    pixels = np.asarray(pixel_values, np.float32)
    p = int(np.prod(grid, axis=1).sum())
    if pixels.shape[0] != p:
        raise ValueError(f"{pixels.shape[0]} patches for grids {grid.tolist()} ({p})")
    if num_patches < p or num_patches % unit:
        raise ValueError(f"bucket {num_patches}: not >= {p} patches and a multiple of {unit}")
    return grid, pixels, p


def merge_order_positions(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """HF's `get_vision_position_ids`: each patch's (h, w) grid position, i64[P, 2], patches
    in the processor's order (merge blocks of merge x merge patches, row-major; frames
    repeat the positions)."""
    out = []
    for t, h, w in grid_thw.tolist():
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hw = [p.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for p in (hpos, wpos)]
        out.append(np.tile(np.stack(hw, axis=-1), (t, 1)))
    return np.concatenate(out)


def _concat(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """HF's gate and up biases [F] (or weights [F, D]) interleaved -> [2F] ([2F, D]): row 2f
    is gate f, 2f + 1 up f."""
    return np.stack([gate, up], axis=1).reshape(-1, *gate.shape[1:])


def _concat_kernels(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """HF's gate and up weights [F, D] interleaved, as a kernel [D, 2F]."""
    return _concat(gate, up).T


def segment_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, span: int | None
) -> jax.Array:
    """q, k, v: f32[N, H, hd], seg: i32[N] -> f32[N, H, hd], each query attending (no mask
    beyond that) to the keys of its own segment. span: None for any key; else each segment is
    a contiguous run of at most `span` rows, and a block of queries reads only the keys from
    `span` rows before it to `span` rows after it."""
    n, _, hd = q.shape
    block = min(QUERY_BLOCK, n)
    num_blocks = -(-n // block)
    rows = num_blocks * block
    q = jnp.pad(q, ((0, rows - n), (0, 0), (0, 0)))
    seg_q = jnp.pad(seg, (0, rows - n), constant_values=-2)
    keys = n if span is None else min(n, block + 2 * span)
    scale = hd**-0.5

    def attend(i: jax.Array) -> jax.Array:
        start = i * block
        qb = jax.lax.dynamic_slice_in_dim(q, start, block)
        sq = jax.lax.dynamic_slice_in_dim(seg_q, start, block)
        k_start = 0 if span is None else jnp.clip(start - span, 0, n - keys)
        kb, vb, sk = (jax.lax.dynamic_slice_in_dim(a, k_start, keys) for a in (k, v, seg))
        s = jnp.einsum("qhd,khd->hqk", qb, kb) * scale
        s = jnp.where(sq[None, :, None] == sk[None, None, :], s, jnp.finfo(jnp.float32).min)
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), vb)

    if num_blocks == 1:
        return attend(jnp.int32(0))[:n]
    out = jax.lax.map(attend, jnp.arange(num_blocks, dtype=jnp.int32))
    return out.reshape(rows, *out.shape[2:])[:n]


class VisionAttention(nnx.Module):
    """qkv (fused [D, 3D], bias; its columns head by head, each head's q, k, v side by side,
    so a tensor-parallel split gives each device whole heads) -> 2D rotary on q, k -> segment
    attention -> proj (bias)."""

    def __init__(self, dim: int, num_heads: int, *, dtype, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True, dtype=dtype, rngs=rngs)
        self.proj = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, seg: jax.Array, span: int | None
    ) -> jax.Array:
        """x: [N, D], cos, sin: f32[N, hd], seg: i32[N] -> [N, D]."""
        n = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(n, self.num_heads, 3, -1), 2, 0)

        def rotate(t: jax.Array) -> jax.Array:
            t1, t2 = jnp.split(t, 2, axis=-1)
            return t * cos[:, None] + jnp.concatenate([-t2, t1], axis=-1) * sin[:, None]

        q, k = rotate(q.astype(jnp.float32)), rotate(k.astype(jnp.float32))
        # HF rounds the rotated q, k to x's dtype before its attention
        q, k = q.astype(x.dtype).astype(jnp.float32), k.astype(x.dtype).astype(jnp.float32)
        out = segment_attention(q, k, v.astype(jnp.float32), seg, span=span)
        return self.proj(out.reshape(n, -1).astype(x.dtype))


class VisionMLP(nnx.Module):
    """down(act(gate(x)) * up(x)), biases on all three; gate and up fused [D, 2F],
    interleaved (column 2f gate f, 2f + 1 up f), so a tensor-parallel split keeps pairs."""

    def __init__(self, dim: int, inter: int, act: str, *, dtype, rngs: nnx.Rngs):
        self.act = check_activation(act)
        self.gate_up = Linear(dim, 2 * inter, bias=True, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [N, D] -> [N, D]."""
        h = self.gate_up(x)
        h = h.reshape(*h.shape[:-1], -1, 2)
        gate, up = h[..., 0], h[..., 1]
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)) (RMSNorms, eps 1e-6)."""

    def __init__(self, vc: dict, *, dtype, rngs: nnx.Rngs):
        dim = vc["hidden_size"]
        self.norm1 = RMSNorm(dim, NORM_EPS, dtype=dtype)
        self.norm2 = RMSNorm(dim, NORM_EPS, dtype=dtype)
        self.attn = VisionAttention(dim, vc["num_heads"], dtype=dtype, rngs=rngs)
        self.mlp = VisionMLP(dim, vc["intermediate_size"], vc["hidden_act"], dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, seg, span: int | None) -> jax.Array:
        """x: [N, D] -> [N, D]; cos, sin, seg, span: `VisionAttention`'s."""
        x = x + self.attn(self.norm1(x), cos, sin, seg, span)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """ln_q (RMSNorm), each merge unit's merge**2 rows side by side, fc1 -> exact GELU -> fc2
    (HF's merger.mlp.0 and .2)."""

    def __init__(self, vc: dict, *, dtype, rngs: nnx.Rngs):
        dim = vc["hidden_size"]
        wide = dim * vc["spatial_merge_size"] ** 2
        self.ln_q = RMSNorm(dim, NORM_EPS, dtype=dtype)
        self.fc1 = Linear(wide, wide, bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(wide, vc["out_hidden_size"], bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [N, D] -> [N / merge**2, out_hidden_size]."""
        h = self.ln_q(x).reshape(-1, self.fc1.kernel.shape[0])
        return self.fc2(jax.nn.gelu(self.fc1(h), approximate=False))


class Qwen2_5_VLVisionEncoder(nnx.Module):
    """Qwen2.5-VL's vision tower: `prepare` (host) -> `__call__` (device) on a patch bucket."""

    config_of = staticmethod(vision_config)  # the tower's fields of the HF config

    def __init__(self, config: dict, *, dtype, rngs: nnx.Rngs):
        """config: the HF Qwen2_5_VLConfig as a dict (`vision_config` reads it)."""
        vc = self.vc = vision_config(config)
        self.dtype = dtype
        patch_dim = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
        self.patch_embed = Linear(patch_dim, vc["hidden_size"], dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [VisionBlock(vc, dtype=dtype, rngs=rngs) for _ in range(vc["depth"])]
        )
        self.merger = PatchMerger(vc, dtype=dtype, rngs=rngs)

    @staticmethod
    def prepare(
        config: dict, pixel_values: np.ndarray, image_grid_thw: np.ndarray, num_patches: int
    ) -> dict[str, np.ndarray]:
        """The HF image processor's pixel_values f32[P, C*T*p*p] and image_grid_thw
        i64[num_images, 3] (one image, or several encoded together as HF's `visual` does)
        -> `__call__`'s inputs, N = num_patches (>= P, a multiple of merge**2) rows:

        patches f32[N, C*T*p*p]: the patches in window order, zero rows after P;
        positions i32[N, 2]: each patch's (h, w) rotary position;
        window_segments i32[N]: each patch's window (-1 for padding);
        full_segments i32[N]: each patch's frame, over all images (-1 for padding);
        reverse_index i32[N / merge**2]: the merged row that each output row takes (HF's
        argsort(window_index), padding rows after it)."""
        vc = vision_config(config)
        unit = vc["spatial_merge_size"] ** 2
        grid, pixels, p = checked_patches(pixel_values, image_grid_thw, num_patches, unit)
        index, window_units = window_order(grid, vc)

        def permuted(a: np.ndarray) -> np.ndarray:  # [P, ...] -> [N, ...] in window order
            a = a.reshape(p // unit, unit, *a.shape[1:])[index].reshape(p, *a.shape[1:])
            return np.concatenate([a, np.zeros((num_patches - p, *a.shape[1:]), a.dtype)])

        frames = np.repeat(
            np.arange(int(grid[:, 0].sum())), np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
        )
        windows = np.repeat(np.arange(len(window_units)), window_units * unit)
        pad = np.full(num_patches - p, -1)
        return {
            "patches": permuted(pixels),
            "positions": permuted(merge_order_positions(grid, vc["spatial_merge_size"])).astype(
                np.int32
            ),
            "window_segments": np.concatenate([windows, pad]).astype(np.int32),
            "full_segments": np.concatenate([frames, pad]).astype(np.int32),
            "reverse_index": np.concatenate(
                [np.argsort(index), np.arange(p // unit, num_patches // unit)]
            ).astype(np.int32),
        }

    def __call__(
        self,
        patches: jax.Array,
        positions: jax.Array,
        window_segments: jax.Array,
        full_segments: jax.Array,
        reverse_index: jax.Array,
    ) -> jax.Array:
        """`prepare`'s arrays (N rows) -> [N / merge**2, out_hidden_size] in dtype: the first
        P / merge**2 rows are HF's image embeddings (`visual(...).pooler_output`) in HF's
        order, the rest padding."""
        vc = self.vc
        x = self.patch_embed(patches.astype(self.dtype))
        head_dim = vc["hidden_size"] // vc["num_heads"]
        quarter = np.arange(0, head_dim // 2, 2, dtype=np.float32) / np.float32(head_dim // 2)
        inv_freq = (1.0 / np.float32(vc["rope_theta"]) ** quarter).astype(np.float32)
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, hd / 4]
        angles = jnp.tile(freqs.reshape(freqs.shape[0], -1), 2)  # [N, hd]: h, w, h, w
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        merge = vc["spatial_merge_size"]
        window_span = (vc["window_size"] // merge // vc["patch_size"] * merge) ** 2
        for i, block in enumerate(self.blocks):
            if i in vc["fullatt_block_indexes"]:
                x = block(x, cos, sin, full_segments, None)
            else:
                x = block(x, cos, sin, window_segments, window_span)
        return jnp.take(self.merger(x), reverse_index, axis=0)

    @staticmethod
    def patch_buckets(config: dict, max_patches: int) -> list[int]:
        """The padded patch counts to compile: merge**2 * 16 * 2**k below max_patches, then
        max_patches rounded up to a multiple of merge**2."""
        unit = vision_config(config)["spatial_merge_size"] ** 2
        top = -(-max_patches // unit) * unit
        buckets, size = [], unit * MIN_BUCKET_UNITS
        while size < top:
            buckets.append(size)
            size *= 2
        return [*buckets, top]

    @staticmethod
    def hf_weight(config: dict, path: tuple) -> HFWeight:
        """Our param path (nnx.state's) -> the HF tensors (`visual.*`, as transformers 5.23's
        save_pretrained names them) and how to build it: kernels [in, out] from HF's [out, in]
        (patch_embed's Conv3d [D, C, T, p, p] flattened first); blocks.i.attn.qkv regrouped
        head by head; blocks.i.mlp.gate_up from gate_proj and up_proj interleaved; merger.fc1
        / fc2 from merger.mlp.0 / mlp.2."""
        *modules, leaf = (str(p) for p in path)
        suffix = "bias" if leaf == "bias" else "weight"
        kernel = leaf == "kernel"
        if modules == ["patch_embed"]:
            return HFWeight(
                (f"{HF_PREFIX}patch_embed.proj.weight",), lambda w: w.reshape(w.shape[0], -1).T
            )
        if modules[0] == "merger" and modules[1] in ("fc1", "fc2"):
            name = f"{HF_PREFIX}merger.mlp.{0 if modules[1] == 'fc1' else 2}.{suffix}"
            return HFWeight((name,), np.transpose if kernel else None)
        name = f"{HF_PREFIX}{'.'.join(modules)}"
        if modules[-1] == "qkv":  # q, k, v rows regrouped head by head
            heads = vision_config(config)["num_heads"]
            fuse = functools.partial(fuse_heads, heads=heads)
            return HFWeight((f"{name}.{suffix}",), (lambda w: fuse(w).T) if kernel else fuse)
        if modules[-1] == "gate_up":
            names = tuple(f"{name[: -len('gate_up')]}{p}_proj.{suffix}" for p in ("gate", "up"))
            return HFWeight(names, _concat_kernels if kernel else _concat)
        return HFWeight((f"{name}.{suffix}",), np.transpose if kernel else None)
