"""The pool of physical KV-cache blocks: ref counts, the LRU free queue, and the prefix-cache map
from block hash to block (vLLM V1's BlockPool, one attention type).

A freed block keeps its hash and stays findable until it is handed out again, so a later request
with the same prefix can take it back out of the free queue ("touch") instead of recomputing it.
Eviction is lazy: a block loses its hash only when get_new_blocks pops it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxserve.core.kv_cache_utils import BlockHash

if TYPE_CHECKING:
    from jaxserve.core.request import Request


@dataclass(slots=True, eq=False)  # eq=False: blocks compare and hash by identity
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is findable by prefix
    prev_free_block: KVCacheBlock | None = None  # links are set only while in the free queue
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        # The default repr would follow the free-queue links through the whole list.
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves, so removing a
    block from the middle (a prefix-cache hit on a free block) is O(1). The head is evicted
    first: blocks are appended when freed, so the order is least recently freed first."""

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        # Sentinels keep every real block's prev/next non-None, so no edge cases at the ends.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left to pop")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next to evict) first. O(n); for tests and checks."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of KV-cache group `group`: the same tokens in two
    groups are two blocks (group 0's key is the hash itself)."""
    return block_hash + group.to_bytes(2, "little") if group else block_hash


class BlockPool:
    """Owns every KVCacheBlock. Block 0 is the null block: a placeholder that is never handed
    out or freed, so block id 0 can pad block tables without aliasing real data."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(group_key(block_hash, group))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks from the free-queue head (least recently freed), evicting their cached
        hashes now, and give each a ref count of 1."""
        free = self.free_block_queue.num_free_blocks
        if num_blocks > free:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {free} are free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Make blocks[num_cached_blocks:num_full_blocks] of KV-cache group `group` findable
        by the request's hashes (the null blocks in place of a window's given-back blocks
        are skipped)."""
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], group_key(request.block_hashes[i], group)
            if block.is_null:
                continue
            if block_hash in self.cached_block_hash_to_block:
                # Either a prefix-cache hit (already mapped to this very block), or another block
                # holds the same content (two requests computed it at once): the first stays the
                # one found, and this one is freed without a hash.
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.is_null:
                continue  # a windowed group's placeholder: never held
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching 0 join the free-queue tail in the given
        order (so the first of them will be evicted first)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, because a running
        request's blocks would become unfindable mid-flight for no gain."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the real (non-null) blocks in use, 0..1."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
