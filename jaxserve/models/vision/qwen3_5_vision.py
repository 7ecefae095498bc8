"""Qwen3.5's and Qwen3-VL's vision tower in Flax NNX, on fixed (bucketed) patch counts.

HF's `Qwen3_5VisionModel`: each patch (in the processor's order: merge blocks of merge x merge
patches, row-major) embedded by a linear map of its pixels (the Conv3d, with bias), plus a
learned position embedding resampled bilinearly (align_corners) from its square table to the
image's grid; blocks of LayerNorm, attention over the whole frame (2D rotary on each patch's
(h, w), Qwen2.5-VL's) and a GELU MLP; then the merger (LayerNorm, each unit's merge**2 rows
side by side, fc1, GELU, fc2). No windows. Qwen3-VL adds DeepStack: after each block of
`deepstack_visual_indexes` a merger of its own (its LayerNorm over the merged rows) makes a
further [tokens, out] feature, which the language model adds to the image tokens' hidden
states after its first layers; the tower returns them side by side with the main output.

The host (`prepare`, numpy) pads the patches to a bucket and gives each its rotary position,
its frame (attention segment; -1 for padding) and the four table rows and weights of its
position embedding; the device does the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.linear import Linear
from jaxserve.models.llama import HFWeight
from jaxserve.models.vision.qwen2_5_vl import (
    VisionAttention,
    checked_patches,
    merge_order_positions,
)
from jaxserve.models.vision.vit import ACTIVATIONS, LayerNorm, check_activation, fuse_heads

# transformers 5.23's Qwen3_5VisionConfig defaults (rope_theta: its axial rope's)
VISION_DEFAULTS: dict = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "rope_theta": 10000.0,
    "deepstack_visual_indexes": (),  # Qwen3-VL's class default: (8, 16, 24)
}
HF_PREFIX = "model.visual."
NORM_EPS = 1e-6  # HF hard-codes the tower's LayerNorms' eps


def vision_config(config: dict, deepstack: tuple[int, ...] = ()) -> dict:
    """A full HF Qwen3.5 / Qwen3-VL config dict (or its vision_config) -> the tower's fields,
    HF's class defaults filling the missing ones (deepstack: the DeepStack blocks' default)."""
    raw = dict(config.get("vision_config") or {}) if "vision_config" in config else dict(config)
    rope = raw.get("rope_parameters") or {}
    raw.setdefault("rope_theta", rope.get("rope_theta", VISION_DEFAULTS["rope_theta"]))
    defaults = {**VISION_DEFAULTS, "deepstack_visual_indexes": deepstack}
    out = {k: raw[k] if raw.get(k) is not None else v for k, v in defaults.items()}
    out["deepstack_visual_indexes"] = tuple(int(i) for i in out["deepstack_visual_indexes"])
    return out


def position_taps(grid_thw: np.ndarray, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """The bilinear (align_corners) resampling of a side x side table to each image's (h, w)
    grid, per patch in the processor's order: (rows of the table i32[P, 4], weights f32[P, 4])."""
    rows, weights = [], []
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        hw = merge_order_positions(np.array([[1, h, w]]), merge)  # [h * w, 2]: (row, col)
        axes = []
        for coord, size in ((hw[:, 0], h), (hw[:, 1], w)):
            src = coord.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            floor = np.floor(src)
            taps = np.clip(floor[:, None] + np.arange(2), 0, side - 1).astype(np.int64)
            near = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0, None)
            axes.append((taps, near.astype(np.float32)))
        (h_taps, h_w), (w_taps, w_w) = axes
        rows.append(
            np.tile((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4), (t, 1))
        )
        weights.append(np.tile((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4), (t, 1)))
    return np.concatenate(rows).astype(np.int32), np.concatenate(weights)


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)), then + fc2(act(fc1(norm2(x)))) (LayerNorms, biases everywhere)."""

    def __init__(self, vc: dict, *, dtype, rngs: nnx.Rngs):
        dim, inter = vc["hidden_size"], vc["intermediate_size"]
        self.norm1 = LayerNorm(dim, NORM_EPS, dtype=dtype)
        self.norm2 = LayerNorm(dim, NORM_EPS, dtype=dtype)
        self.attn = VisionAttention(dim, vc["num_heads"], dtype=dtype, rngs=rngs)
        self.act = check_activation(vc["hidden_act"])
        self.fc1 = Linear(dim, inter, bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(inter, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, seg) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, seg, None)
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(self.norm2(x))))


class Merger(nnx.Module):
    """LayerNorm (over each row, or with `wide` over each unit's merged rows), the unit's
    merge**2 rows side by side, fc1, exact GELU, fc2."""

    def __init__(self, vc: dict, wide: bool, *, dtype, rngs: nnx.Rngs):
        dim, unit = vc["hidden_size"], vc["spatial_merge_size"] ** 2
        self.wide = wide
        self.norm = LayerNorm(dim * unit if wide else dim, NORM_EPS, dtype=dtype)
        self.fc1 = Linear(dim * unit, dim * unit, bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(dim * unit, vc["out_hidden_size"], bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [N, D] -> [N / merge**2, out_hidden_size]."""
        width = self.fc1.kernel.shape[0]
        h = self.norm(x.reshape(-1, width)) if self.wide else self.norm(x).reshape(-1, width)
        return self.fc2(jax.nn.gelu(self.fc1(h), approximate=False))


class Qwen3_5VisionEncoder(nnx.Module):
    """Qwen3.5's vision tower: `prepare` (host) -> `__call__` (device) on a patch bucket."""

    deepstack_default: tuple[int, ...] = ()

    @classmethod
    def config_of(cls, config: dict) -> dict:
        return vision_config(config, cls.deepstack_default)

    @classmethod
    def num_deepstack(cls, config: dict) -> int:
        """The further features per image token (DeepStack's)."""
        return len(cls.config_of(config)["deepstack_visual_indexes"])

    def __init__(self, config: dict, *, dtype, rngs: nnx.Rngs):
        vc = self.vc = self.config_of(config)
        self.dtype = dtype
        dim = vc["hidden_size"]
        patch_dim = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
        self.patch_embed = Linear(patch_dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Param(jnp.zeros((vc["num_position_embeddings"], dim), dtype))
        self.blocks = nnx.List(
            [VisionBlock(vc, dtype=dtype, rngs=rngs) for _ in range(vc["depth"])]
        )
        self.merger = Merger(vc, False, dtype=dtype, rngs=rngs)
        self.deepstack = nnx.List(
            [Merger(vc, True, dtype=dtype, rngs=rngs) for _ in vc["deepstack_visual_indexes"]]
        )

    @staticmethod
    def prepare(
        config: dict, pixel_values: np.ndarray, image_grid_thw: np.ndarray, num_patches: int
    ) -> dict[str, np.ndarray]:
        """The image processor's pixel_values f32[P, C*T*p*p] and image_grid_thw i64[n, 3]
        -> `__call__`'s inputs over N = num_patches rows (zero rows after P): patches, their
        (h, w) rotary positions i32[N, 2], frames i32[N] (-1: padding) and the position
        embedding's table rows i32[N, 4] and weights f32[N, 4]."""
        vc = vision_config(config)  # (its DeepStack blocks are not read here)
        unit = vc["spatial_merge_size"] ** 2
        grid, pixels, p = checked_patches(pixel_values, image_grid_thw, num_patches, unit)

        def padded(a: np.ndarray, fill=0) -> np.ndarray:
            return np.concatenate([a, np.full((num_patches - p, *a.shape[1:]), fill, a.dtype)])

        side = int(vc["num_position_embeddings"] ** 0.5)
        taps, weights = position_taps(grid, side, vc["spatial_merge_size"])
        frames = np.repeat(
            np.arange(int(grid[:, 0].sum())), np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
        )
        positions = merge_order_positions(grid, vc["spatial_merge_size"]).astype(np.int32)
        return {
            "patches": padded(pixels),
            "positions": padded(positions),
            "segments": padded(frames.astype(np.int32), -1),
            "pos_rows": padded(taps),
            "pos_weights": padded(weights),
        }

    def __call__(self, patches, positions, segments, pos_rows, pos_weights) -> jax.Array:
        """`prepare`'s arrays (N rows) -> [N / merge**2, (1 + k) out_hidden_size] in dtype:
        the image embeddings, then each of the k DeepStack features (the first P / merge**2
        rows are HF's, the rest padding)."""
        vc = self.vc
        x = self.patch_embed(patches.astype(self.dtype))
        table = self.pos_embed[...]
        x = x + jnp.einsum("nk,nkd->nd", pos_weights, table[pos_rows].astype(jnp.float32)).astype(
            x.dtype
        )
        head_dim = vc["hidden_size"] // vc["num_heads"]
        quarter = np.arange(0, head_dim // 2, 2, dtype=np.float32) / np.float32(head_dim // 2)
        inv_freq = (1.0 / np.float32(vc["rope_theta"]) ** quarter).astype(np.float32)
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, hd / 4]
        angles = jnp.tile(freqs.reshape(freqs.shape[0], -1), 2)  # [N, hd]: h, w, h, w
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        stacked = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in vc["deepstack_visual_indexes"]:
                stacked.append(self.deepstack[vc["deepstack_visual_indexes"].index(i)](x))
        return jnp.concatenate([self.merger(x), *stacked], axis=-1)

    @staticmethod
    def hf_weight(config: dict, path: tuple) -> HFWeight:
        """Our param path -> the HF tensors (`model.visual.*`): kernels [in, out] from HF's
        [out, in] (the Conv3d [D, C, T, p, p] flattened first); qkv regrouped head by head;
        blocks' fc1 / fc2 from mlp.linear_fc1 / fc2; the merger's from merger.norm /
        linear_fc1 / linear_fc2 (DeepStack's from deepstack_merger_list.j)."""
        *modules, leaf = (str(p) for p in path)
        suffix = "bias" if leaf == "bias" else "weight"
        kernel = leaf == "kernel"
        if modules == ["patch_embed"]:
            name = f"{HF_PREFIX}patch_embed.proj.{suffix}"
            return HFWeight((name,), (lambda w: w.reshape(w.shape[0], -1).T) if kernel else None)
        if modules == [] and leaf == "pos_embed":
            return HFWeight((f"{HF_PREFIX}pos_embed.weight",))
        if modules[0] in ("merger", "deepstack"):  # HF's merger / deepstack_merger_list.j
            where = "merger" if modules[0] == "merger" else f"deepstack_merger_list.{modules[1]}"
            part = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}[modules[-1]]
            name = f"{HF_PREFIX}{where}.{part}.{suffix}"
            return HFWeight((name,), np.transpose if kernel else None)
        if modules[-1] in ("fc1", "fc2"):
            modules = [*modules[:-1], "mlp", f"linear_{modules[-1]}"]
        name = f"{HF_PREFIX}{'.'.join(modules)}"
        if modules[-1] == "qkv":  # q, k, v rows regrouped head by head
            fuse = functools.partial(fuse_heads, heads=vision_config(config)["num_heads"])
            return HFWeight((f"{name}.{suffix}",), (lambda w: fuse(w).T) if kernel else fuse)
        return HFWeight((f"{name}.{suffix}",), np.transpose if kernel else None)


class Qwen3VLVisionEncoder(Qwen3_5VisionEncoder):
    """Qwen3-VL's tower: Qwen3.5's with DeepStack (blocks 8, 16 and 24 by default)."""

    deepstack_default = (8, 16, 24)
