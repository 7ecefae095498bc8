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
(jaxserve's block size stays one power of two for every group). A layer of another width
views the rows of its slot as its own heads, repeated to fill them (models/gemma4.py).

One group of every layer (`KVCacheLayout.uniform`) is the layout of a model with one kind,
and of any model when `--disable-hybrid-kv-cache-manager` is set or it runs in pipeline
stages (each stage holds its own layers): then a windowed layer keeps the whole context, as
before groups. KV connectors and offloading keep the groups: a block position moves with its
block of every group (core/kv_cache_manager.py::connector_block_ids).
"""

from __future__ import annotations

import dataclasses
import logging
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
    """The groups, each of num_slots layers at most; position(i) gives cached layer i's
    (group, slot). Hashable: the attention metadata carries it as static data."""

    groups: tuple[KVCacheGroup, ...]
    num_slots: int

    @classmethod
    def uniform(cls, num_layers: int, kind: str = FULL, span: int | None = None):
        """One group of every layer (slots 0 .. num_layers - 1)."""
        return cls((KVCacheGroup(kind, span, tuple(range(num_layers))),), max(num_layers, 1))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def position(self, layer: int) -> tuple[int, int]:
        """(group, slot) of cached layer `layer`."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
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
        return f"{' + '.join(parts)} of {self.num_slots} layers"


def layer_kind(window: int | None, chunk: int | None) -> tuple[str, int | None]:
    """A layer's (kind, span) from its sliding window and attention chunk."""
    if chunk is not None:
        return CHUNKED, chunk
    if window is not None:
        return SLIDING, window
    return FULL, None


def group_layers(kinds: Sequence[tuple[str, int | None]]) -> KVCacheLayout:
    """The layout of cached layers whose (kind, span) are `kinds` (one per cached layer):
    one group when they are all alike, else groups of S layers (the module's rule), full
    attention's first."""
    by_kind: dict[tuple[str, int | None], list[int]] = {}
    for i, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(i)
    if len(by_kind) <= 1:
        kind, span = next(iter(by_kind), (FULL, None))
        return KVCacheLayout.uniform(len(kinds), kind, span)
    sizes = [len(layers) for layers in by_kind.values()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.25 else min(sizes)
    # full attention first: a draft model or EAGLE head (every position) uses group 0's blocks
    order = sorted(by_kind, key=lambda k: (k[0] != FULL, k[0], k[1] or 0))
    groups = tuple(
        KVCacheGroup(kind, span, tuple(by_kind[(kind, span)][i : i + size]))
        for kind, span in order
        for i in range(0, len(by_kind[(kind, span)]), size)
    )
    return KVCacheLayout(groups, size)


def kv_cache_layout(config: ModelConfig, one_group: str | None = None) -> KVCacheLayout:
    """The layout of the model's cached layers (ModelConfig.kv_layers); one_group: why the
    model must keep one group of every layer (logged), or None."""
    kinds = [layer_kind(config.layer_window(i), config.layer_chunk(i)) for i in config.kv_layers]
    layout = group_layers(kinds)
    if layout.num_groups > 1 and one_group:
        logger.info(
            "KV cache: one group of every layer (%s): windowed layers keep it all", one_group
        )
        return KVCacheLayout.uniform(len(kinds))
    if layout.num_groups > 1:
        logger.info("KV cache: %s", layout.describe())
    return layout
