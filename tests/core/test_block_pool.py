"""BlockPool and its free queue: LRU order, the null block, lazy eviction, ref counts."""

import pytest

from jaxserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _ids(blocks):
    return [b.block_id for b in blocks]


def _request(request_id, token_ids):
    sp = SamplingParams()
    return Request(request_id, token_ids, sp, eos_token_id=None, block_size=BLOCK_SIZE)


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]

    queue.remove(blocks[2])  # O(1): relinks its neighbours directly
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert queue.num_free_blocks == 4

    assert queue.popleft() is blocks[0]
    assert _ids(queue.popleft_n(2)) == [1, 3]
    queue.append(blocks[2])
    queue.append_n([blocks[0], blocks[1]])
    assert _ids(queue.get_all_free_blocks()) == [4, 2, 0, 1]
    assert queue.num_free_blocks == 4


def test_free_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="cannot pop 3 blocks, only 2"):
        queue.popleft_n(3)
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert _ids(blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block, *blocks])  # the null block is skipped
    assert pool.null_block.ref_cnt == 0
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4]


def test_free_appends_in_given_order_and_rejects_double_free():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a, b])
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 1, 2]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a])


def test_cache_full_blocks_and_lazy_eviction():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    req = _request("a", list(range(10)))  # two full blocks, one partial
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert blocks[2].block_hash is None
    assert len(pool.cached_block_hash_to_block) == 2

    # Freed blocks stay findable until they are handed out again.
    pool.free_blocks(blocks)
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[0]
    assert reused.block_hash is None
    assert pool.get_cached_block(req.block_hashes[0]) is None
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    req = _request("a", list(range(4)))
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [first], 0, 1)
    pool.cache_full_blocks(req, [second], 0, 1)
    assert pool.get_cached_block(req.block_hashes[0]) is first
    assert second.block_hash is None
    # Evicting the uncached duplicate must not drop the first block's entry.
    pool.free_blocks([second])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(req.block_hashes[0]) is first


def test_caching_disabled_caches_nothing():
    pool = BlockPool(num_blocks=4, enable_caching=False)
    req = _request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in blocks)


def test_touch_pulls_free_blocks_out_of_the_queue():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3
    pool.touch([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 2)
    assert pool.get_num_free_blocks() == 2
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4]


def test_usage_and_reset_prefix_cache():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.get_usage() == 0.0
    req = _request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.get_usage() == pytest.approx(0.5)
    assert pool.reset_prefix_cache() is False  # refused while blocks are in use
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)


def test_too_few_blocks_is_rejected():
    with pytest.raises(ValueError, match="num_blocks must be at least 2"):
        BlockPool(num_blocks=1, enable_caching=True)
