"""KV-cache groups: a model's attention layers grouped by what each keeps of the context
(vLLM V1's hybrid KV cache manager, "uniform page size" layout).

A group is a set of layers of one attention kind: full attention (every earlier token),
a sliding window of W tokens (Gemma 2 / 3's local layers, gpt-oss's banded ones) or chunked
local attention of C tokens (Llama 4). Each group has its own block table per request and
its own allocation rule (a windowed group gives back the blocks that fell out of its window
as the request runs), and every group draws from one block pool.

Pool rule: every group has the same number of layers, S (vLLM's rule: the fewest layers of
any kind, or the most when the kinds' counts are within 25% of each other; a kind's last
group is padded with unused slots). The cache is then S slots of the pool's P blocks
([S * P, block_size, H, d]): block b of slot s is row s * P + b, and the group that holds
block id b uses row s * P + b for its s-th layer. So one block id is one block of S layers
whatever group holds it, and the groups share the pool without a page size of their own
(jaxserve's block size stays one power of two for every group). A layer of a narrower width
(1/k of a token's row: `layer_packs`) shares its slot with k - 1 others of its kind, each in
its own 1/k of every block's bytes (KVCacheGroup.pack; S then counts slots); where it cannot
(one group of every layer) it repeats its heads to fill the row (models/gemma4.py).

One group of every layer (`KVCacheLayout.uniform`) is the layout of a model with one kind,
and of any model when `--disable-hybrid-kv-cache-manager` is set or it runs in pipeline
stages (each stage holds its own layers): then a windowed layer keeps the whole context, as
before groups. KV connectors and offloading keep the groups: a block position moves with its
block of every group (core/kv_cache_manager.py::connector_block_ids).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.config.model import ModelConfig

logger = logging.getLogger(__name__)

FULL, SLIDING, CHUNKED = "full", "sliding", "chunked"


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one attention kind. layers: indices into the model's cached layers
    (ModelConfig.kv_layers), in order; span: the window (sliding) or chunk (chunked) in
    tokens, None for full attention."""

    kind: str
    span: int | None
    layers: tuple[int, ...]
    pack: int = 1  # layers a slot holds (narrower ones: models/gemma4.py)

    def first_needed_token(self, next_position: int) -> int:
        """The earliest key position the token at next_position (and every later one) reads:
        the blocks wholly before it can be given back."""
        if self.kind == SLIDING:
            return max(0, next_position - self.span + 1)
        if self.kind == CHUNKED:
            return next_position // self.span * self.span
        return 0


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """The groups, each of num_slots slots at most; place(i) gives cached layer i's
    (group, slot, sub, pack). Hashable: the attention metadata carries it as static data."""

    groups: tuple[KVCacheGroup, ...]
    num_slots: int

    @classmethod
    def uniform(cls, num_layers: int, kind: str = FULL, span: int | None = None):
        """One group of every layer (slots 0 .. num_layers - 1)."""
        return cls((KVCacheGroup(kind, span, tuple(range(num_layers))),), max(num_layers, 1))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def place(self, layer: int) -> tuple[int, int, int, int]:
        """(group, slot, sub, pack) of cached layer `layer`: its group packs `pack` layers in
        a slot, this one the sub-th (a block id b of the slot is then `pack` blocks of the
        layer's width: view block pack * b + sub)."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                i = group.layers.index(layer)
                return g, i // group.pack, i % group.pack, group.pack
        raise ValueError(f"layer {layer} is in no KV-cache group of {self}")

    @property
    def has_full_group(self) -> bool:
        return any(g.kind == FULL for g in self.groups)

    def describe(self) -> str:
        """e.g. '1 full group + 6 sliding-1024 groups of 10 layers'."""
        counts: dict[str, int] = {}
        for g in self.groups:
            name = g.kind if g.span is None else f"{g.kind}-{g.span}"
            counts[name] = counts.get(name, 0) + 1
        parts = [f"{n} {name} group{'s' * (n > 1)}" for name, n in counts.items()]
        packed = [f"{g.kind} {g.pack} a slot" for g in self.groups if g.pack > 1]
        packed = f" ({', '.join(dict.fromkeys(packed))})" if packed else ""
        return f"{' + '.join(parts)} of {self.num_slots} slots{packed}"


def layer_kind(window: int | None, chunk: int | None) -> tuple[str, int | None]:
    """A layer's (kind, span) from its sliding window and attention chunk."""
    if chunk is not None:
        return CHUNKED, chunk
    if window is not None:
        return SLIDING, window
    return FULL, None


def group_layers(
    kinds: Sequence[tuple[str, int | None]], packs: Sequence[int] | None = None
) -> KVCacheLayout:
    """The layout of cached layers whose (kind, span) are `kinds` (one per cached layer):
    one group when they are all alike, else groups of S slots (the module's rule, counting
    slots: packs[i] layers of layer i's kind share one), full attention's first."""
    packs = packs or [1] * len(kinds)
    by_kind: dict[tuple[str, int | None, int], list[int]] = {}
    for i, (kind, span) in enumerate(kinds):
        by_kind.setdefault((kind, span, packs[i]), []).append(i)
    if len({k[:2] for k in by_kind}) <= 1:
        kind, span = kinds[0] if kinds else (FULL, None)
        return KVCacheLayout.uniform(len(kinds), kind, span)
    sizes = [-(-len(layers) // pack) for (_, _, pack), layers in by_kind.items()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.25 else min(sizes)
    # full attention first: a draft model or EAGLE head (every position) uses group 0's blocks
    order = sorted(by_kind, key=lambda k: (k[0] != FULL, k[0], k[1] or 0, k[2]))
    groups = tuple(
        KVCacheGroup(kind, span, tuple(by_kind[key][i : i + size * pack]), pack)
        for key in order
        for kind, span, pack in [key]
        for i in range(0, len(by_kind[key]), size * pack)
    )
    return KVCacheLayout(groups, size)


def cache_head_replicas(config: ModelConfig, tp: int) -> int:
    """Copies of each KV head in the qkv projection and the KV cache: 1 when tp divides the
    KV heads, tp // num_kv_heads when tp is a multiple of them. With layers of other widths
    (Gemma 4's full layers: H_l heads of d_l, config.layer_kv_shape) the fewest copies R
    such that each device's share of the cache's H_c = num_kv_heads * R heads of head_dim
    is whole heads of every layer's d_l, and H_c head_dim / d_l is a multiple of its H_l
    (distributed/sharding.py::kv_head_replicas)."""
    h, d = config.num_kv_heads, config.head_dim
    shapes = {config.layer_kv_shape(layer) for layer in config.kv_layers} or {(h, d)}
    for replicas in range(1, 64 * tp + 1):
        cache = h * replicas
        if cache % tp == 0 and all(
            cache // tp * d % dl == 0 and cache * d // dl % hl == 0 for hl, dl in shapes
        ):
            return replicas
    raise ValueError(f"no KV cache row holds every layer's KV heads {sorted(shapes)} at tp {tp}")


def layer_packs(config: ModelConfig, tp: int = 1) -> list[int]:
    """Per cached layer, how many such layers one slot's rows hold: a layer whose heads
    (H_l of d_l) fill only a 1/k of a token's row ([H_c, head_dim]) shares the slot with k - 1
    others of its kind, each in its own 1/k of every block's bytes; k is the most that still
    leaves whole heads on each of the tp devices (1 for one width)."""
    view = config.num_kv_heads * cache_head_replicas(config, tp) * config.head_dim
    packs = []
    for layer in config.kv_layers:
        heads, dim = config.layer_kv_shape(layer)
        packs.append(math.gcd(view // dim // heads, view // dim // tp))
    return packs


def kv_cache_layout(
    config: ModelConfig, one_group: str | None = None, tp: int = 1
) -> KVCacheLayout:
    """The layout of the model's cached layers (ModelConfig.kv_layers) at tensor-parallel
    size tp; one_group: why the model must keep one group of every layer (logged), or None."""
    kinds = [layer_kind(config.layer_window(i), config.layer_chunk(i)) for i in config.kv_layers]
    layout = group_layers(kinds, layer_packs(config, tp))
    if layout.num_groups > 1 and one_group:
        logger.info(
            "KV cache: one group of every layer (%s): windowed layers keep it all", one_group
        )
        return KVCacheLayout.uniform(len(kinds))
    if layout.num_groups > 1:
        logger.info("KV cache: %s", layout.describe())
    return layout
