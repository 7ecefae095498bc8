"""Which KV-cache blocks each request holds (vLLM V1's KVCacheManager, one attention type).

With a sliding window on every layer (`sliding_window`), a request's blocks that every later
token is past are given back as it runs (vLLM's SlidingWindowManager): its block list keeps
the null block in their place, so positions still index it. The runner's block table keeps
the old ids there; the attention never reads keys outside the window.

The scheduler asks get_computed_blocks for a new request's prefix-cache hit, then
allocate_slots for the blocks its next tokens need, and free when the request finishes or is
preempted. Blocks are cached by hash as soon as they are allocated full of known tokens: the
model runner computes them in the same step, before any other request can read them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.request import Request


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


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's, or None
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already cached by hash.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.on_reset: list = []  # called once the prefix cache is reset (core/state_cache.py)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as (blocks, number of tokens). Does not take
        references: allocate_slots does, once it knows the request fits."""
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        # Leave at least the last token to compute: its logits give the next token.
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # hashes chain, so no later block can hit either
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for its prefix-cache hit plus num_new_tokens more tokens,
        and room for num_lookahead_tokens after them (a draft model's proposals). Returns the
        newly allocated blocks, or None if they do not fit (then only blocks that fell out of
        the sliding window have been given back). delay_cache_blocks: the new tokens' KV
        arrives later (a remote KV load): their blocks become findable by hash only at the
        request's next allocate_slots, once it runs."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        if not new_computed_blocks and self.fits(request, num_new_tokens + num_lookahead_tokens):
            return []  # a decode within its last block: the common case, kept cheap
        self.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-(num_total + num_lookahead_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # A hit on a free block takes it out of the free queue, so it counts against the space.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        # Touch before allocating, so popping new blocks cannot evict the hits.
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)

        # Cache only blocks full of known tokens; a speculative tail has no tokens to hash yet.
        num_full_blocks = min(num_total, request.num_tokens) // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if delay_cache_blocks:
            num_full_blocks = request.num_computed_tokens + num_new_computed_tokens
            num_full_blocks //= self.block_size
        if num_full_blocks > num_cached:
            self.block_pool.cache_full_blocks(request, req_blocks, num_cached, num_full_blocks)
            num_cached = num_full_blocks
        self.num_cached_block[request.request_id] = num_cached
        return new_blocks

    def fits(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already hold its next num_new_tokens, with no block
        to cache and none to give back: allocate_slots would change nothing."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None or self.sliding_window is not None:
            return False
        end = request.num_computed_tokens + num_new_tokens
        full = min(end, len(request.all_token_ids)) // self.block_size
        return (
            end <= len(blocks) * self.block_size
            and full <= self.num_cached_block[request.request_id]
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Sliding window: give back the leading blocks wholly before the window of the next
        token (position num_computed_tokens sees keys from num_computed_tokens - window + 1
        on), putting the null block in their place."""
        blocks = self.req_to_blocks.get(request_id)
        if self.sliding_window is None or not blocks:
            return
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1)
        skipped = []
        for i in reversed(range(min(first_needed // self.block_size, len(blocks)))):
            if blocks[i].is_null:
                break  # the earlier ones went at an earlier step
            skipped.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(skipped)  # latest first, as `free` orders them

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: the free queue evicts in that order, and a
        prompt's head blocks are the ones other requests are likeliest to share."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks[request_id]]

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
        """Raise RuntimeError unless every block's ref count equals the number of requests holding
        it and the free queue holds exactly the unreferenced blocks. With no requests held, this
        means every ref count is 0 and num_blocks - 1 blocks are free."""
        pool = self.block_pool
        holders = Counter(
            b for blocks in self.req_to_blocks.values() for b in blocks if not b.is_null
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
        for block_hash, block in pool.cached_block_hash_to_block.items():
            if block.block_hash != block_hash:
                problems.append(f"{block} is mapped under hash {block_hash.hex()[:8]}")
        if problems:
            raise RuntimeError("KV cache block accounting is broken: " + "; ".join(problems))
