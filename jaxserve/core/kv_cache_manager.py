"""Which KV-cache blocks each request holds (vLLM V1's KVCacheManager with its hybrid groups).

A request holds a block list per KV-cache group (config/kv_groups.py: the model's layers
grouped by attention kind), all drawn from one block pool; list i of every group covers the
same block_size tokens. A windowed group (sliding window, chunked local attention) gives
back the blocks every later token is past as the request runs (vLLM's SlidingWindowManager
and ChunkedLocalAttentionManager): its list keeps the null block in their place, so
positions still index it; the attention never reads keys outside its window or chunk.

The scheduler asks get_computed_blocks for a new request's prefix-cache hit (the longest
prefix every group can serve: a full group needs all its blocks, a windowed group only the
blocks the next token reads), then allocate_slots for the blocks its next tokens need, and
free when the request finishes or is preempted. Blocks are cached by hash (and group) as soon
as they are allocated full of known tokens: the model runner computes them in the same step,
before any other request can read them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

from jaxserve.config.kv_groups import FULL, KVCacheGroup, KVCacheLayout
from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.request import Request

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one list per group


@dataclasses.dataclass
class PrefixCacheStats:
    requests: int = 0  # requests looked up
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def block_ids(blocks: GroupBlocks) -> tuple[list[int], ...]:
    """Each group's block ids; () when no group has any (a decode within its blocks)."""
    return tuple([b.block_id for b in g] for g in blocks) if any(blocks) else ()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        groups: Sequence[KVCacheGroup] = KVCacheLayout.uniform(1).groups,
    ):
        """groups: the layout's groups (KVCacheLayout.groups); the default: one group of
        full attention."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = tuple(groups)
        self.windowed = any(g.kind != FULL for g in self.groups)
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        # How many of a request's leading blocks are already cached by hash (every group).
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.on_reset: list = []  # called once the prefix cache is reset (core/state_cache.py)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def no_blocks(self) -> GroupBlocks:
        return tuple([] for _ in self.groups)

    def get_computed_blocks(
        self, request: Request, trim: Callable[[Request, int], int] | None = None
    ) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of the request that every group serves, as (each group's
        blocks, number of tokens). trim(request, n) -> a shorter hit a caller can use (a multiple of
        the block size: a scheduler gate's rule); the hit is then looked up again below it.
        Does not take references: allocate_slots does, once it knows the request fits."""
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.no_blocks(), 0
        # Leave at least the last token to compute: its logits give the next token.
        n = (request.num_tokens - 1) // self.block_size
        found: list[dict[int, KVCacheBlock | None]] = [{} for _ in self.groups]
        while True:
            n = self._longest_hit(request, n, found)
            cut = trim(request, n * self.block_size) // self.block_size if trim and n else n
            if cut >= n:
                break
            n = cut
        blocks = tuple(
            [self.block_pool.null_block] * (first := self._first_needed(g, n))
            + [found[i][j] for j in range(first, n)]
            for i, g in enumerate(self.groups)
        )
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += n * self.block_size
        return blocks, n * self.block_size

    def _first_needed(self, group: KVCacheGroup, num_blocks: int) -> int:
        """The first block the token after num_blocks full blocks reads in `group`."""
        return group.first_needed_token(num_blocks * self.block_size) // self.block_size

    def _longest_hit(self, request: Request, n: int, found: list[dict]) -> int:
        """The most blocks, at most n, that every group holds cached (found: each group's
        lookups so far, filled in)."""
        pool, hashes = self.block_pool, request.block_hashes

        def missing(g: int, lo: int, hi: int) -> int | None:
            """The last block in [lo, hi) group g has not cached, or None."""
            for j in range(hi - 1, lo - 1, -1):
                if j not in found[g]:
                    found[g][j] = pool.get_cached_block(hashes[j], g)
                if found[g][j] is None:
                    return j
            return None

        for g, group in enumerate(self.groups):  # full attention: a prefix of hits
            if group.kind == FULL:
                for j in range(n):
                    if missing(g, j, j + 1) is not None:
                        n = j
                        break
        done = False
        while n and not done:  # a windowed group: the blocks its window needs
            done = True
            for g, group in enumerate(self.groups):
                if group.kind != FULL:
                    miss = missing(g, self._first_needed(group, n), n)
                    if miss is not None:  # any hit containing it in its window fails too
                        n, done = miss, False
                        break
        return n

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks = (),
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlocks | None:
        """Give the request blocks for its prefix-cache hit plus num_new_tokens more tokens,
        and room for num_lookahead_tokens after them (a draft model's proposals). Returns each
        group's newly allocated blocks, or None if they do not fit (then only blocks that fell
        out of a window have been given back). delay_cache_blocks: the new tokens' KV arrives
        later (a remote KV load): their blocks become findable by hash only at the request's
        next allocate_slots, once it runs."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        hits = new_computed_blocks or self.no_blocks()
        if not any(hits) and self.fits(request, num_new_tokens + num_lookahead_tokens):
            return self.no_blocks()  # a decode within its last block: the common case, cheap
        self.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        held = self.req_to_blocks.get(request.request_id) or self.no_blocks()
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-(num_total + num_lookahead_tokens) // self.block_size)
        counts = [max(0, num_required - len(h) - len(c)) for h, c in zip(held, hits, strict=True)]
        # A hit on a free block takes it out of the free queue, so it counts against the space.
        num_free_hits = sum(1 for c in hits for b in c if b.ref_cnt == 0 and not b.is_null)
        if sum(counts) + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        # Touch before allocating, so popping new blocks cannot evict the hits.
        for c in hits:
            self.block_pool.touch(c)
        new_blocks = tuple(self.block_pool.get_new_blocks(n) for n in counts)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, self.no_blocks())
        for blocks, c, new in zip(req_blocks, hits, new_blocks, strict=True):
            blocks.extend(c)
            blocks.extend(new)

        # Cache only blocks full of known tokens; a speculative tail has no tokens to hash yet.
        num_full_blocks = min(num_total, request.num_tokens) // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if delay_cache_blocks:
            num_full_blocks = request.num_computed_tokens + num_new_computed_tokens
            num_full_blocks //= self.block_size
        if num_full_blocks > num_cached:
            for g, blocks in enumerate(req_blocks):
                self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full_blocks, g)
            num_cached = num_full_blocks
        self.num_cached_block[request.request_id] = num_cached
        return new_blocks

    def fits(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already hold its next num_new_tokens, with no block
        to cache and none to give back: allocate_slots would change nothing."""
        held = self.req_to_blocks.get(request.request_id)
        if held is None:
            return False
        start = request.num_computed_tokens
        end = start + num_new_tokens
        full = min(end, len(request.all_token_ids)) // self.block_size
        if end > len(held[0]) * self.block_size or full > self.num_cached_block[request.request_id]:
            return False
        if not self.windowed:
            return True
        for group, blocks in zip(self.groups, held, strict=True):
            first = group.first_needed_token(start) // self.block_size
            if first and not blocks[first - 1].is_null:
                return False  # a block to give back
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Windowed groups: give back the leading blocks wholly before what the next token
        (position num_computed_tokens) reads, putting the null block in their place."""
        held = self.req_to_blocks.get(request_id)
        if not self.windowed or not held:
            return
        for group, blocks in zip(self.groups, held, strict=True):
            first_needed = group.first_needed_token(num_computed_tokens) // self.block_size
            skipped = []
            for i in reversed(range(min(first_needed, len(blocks)))):
                if blocks[i].is_null:
                    break  # the earlier ones went at an earlier step
                skipped.append(blocks[i])
                blocks[i] = self.block_pool.null_block
            self.block_pool.free_blocks(skipped)  # latest first, as `free` orders them

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: the free queue evicts in that order, and a
        prompt's head blocks are the ones other requests are likeliest to share."""
        held = self.req_to_blocks.pop(request.request_id, ())
        self.num_cached_block.pop(request.request_id, None)
        for blocks in held:
            self.block_pool.free_blocks(reversed(blocks))

    def most_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of num_tokens tokens (prefilled in chunks of at most
        `chunk`) can hold: all of a full-attention group's; of a windowed group, the blocks
        from what a chunk's first token reads to its last token (its span and the chunk, a
        partial block at each end)."""
        bs, every = self.block_size, -(-num_tokens // self.block_size)
        step = min(chunk, num_tokens)
        return sum(
            every if g.kind == FULL else min(every, (g.span + step + 2 * bs - 3) // bs)
            for g in self.groups
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's block ids of the request."""
        return tuple([b.block_id for b in g] for g in self.req_to_blocks[request_id])

    def connector_block_ids(self, request_id: str) -> list:
        """The request's blocks for a KV connector, per block position: its block id (one
        group), or the tuple of every group's (the null block, 0, where a window gave one
        back); the connector moves a position's blocks of every group together."""
        ids = self.get_block_ids(request_id)
        return ids[0] if len(ids) == 1 else list(zip(*ids, strict=True))

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The counts since the last call; resets them."""
        stats = dataclasses.replace(self.prefix_cache_stats)
        self.prefix_cache_stats.reset()
        return stats

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache()
        for reset in self.on_reset if done else ():
            reset()
        return done

    def check_no_leaks(self) -> None:
        """Raise RuntimeError unless every block's ref count equals the number of request
        groups holding it and the free queue holds exactly the unreferenced blocks. With no
        requests held, this means every ref count is 0 and num_blocks - 1 blocks are free."""
        pool = self.block_pool
        holders = Counter(
            b for held in self.req_to_blocks.values() for g in held for b in g if not b.is_null
        )  # a request holds the null block only in place of blocks out of its window
        free = set(pool.free_block_queue.get_all_free_blocks())
        problems = []
        for block in pool.blocks[1:]:
            if block.ref_cnt != holders[block]:
                problems.append(f"{block} is held by {holders[block]} requests")
            if (block.ref_cnt == 0) != (block in free):
                problems.append(f"{block} is {'' if block in free else 'not '}in the free queue")
        if pool.null_block in free or holders[pool.null_block]:
            problems.append("the null block is in the free queue or held by a request")
        num_free = pool.get_num_free_blocks()
        if len(free) != num_free:
            problems.append(f"free queue has {len(free)} blocks but counts {num_free}")
        for key, block in pool.cached_block_hash_to_block.items():
            if block.block_hash != key:
                problems.append(f"{block} is mapped under hash {key.hex()[:8]}")
        if problems:
            raise RuntimeError("KV cache block accounting is broken: " + "; ".join(problems))
