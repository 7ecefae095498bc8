"""KVCacheManager: prefix hits, allocation, eviction order, ref counts, stats."""

import pytest

from jaxserve.config.kv_groups import (
    CHUNKED,
    FULL,
    SLIDING,
    KVCacheGroup,
    KVCacheLayout,
    group_layers,
)
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

BS = 4  # block size


def _request(request_id, token_ids, cache_salt=None, **sampling):
    return Request(
        request_id,
        token_ids,
        SamplingParams(**sampling),
        eos_token_id=None,
        block_size=BS,
        cache_salt=cache_salt,
    )


def _schedule(manager, request):
    """What the scheduler does for a new request: look up its prefix, allocate the rest.
    Returns (the new blocks of the first group, or None, number of hit tokens)."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    new = manager.allocate_slots(request, num_new, hits, num_hit_tokens)
    return (None if new is None else new[0]), num_hit_tokens


def _hit(manager, request):
    """(the one group's hit blocks, number of hit tokens)."""
    (hits,), num_hit_tokens = manager.get_computed_blocks(request)
    return hits, num_hit_tokens


def _free_ids(manager):
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_allocate_and_free_return_everything():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    req = _request("a", list(range(10)))
    new_blocks, _ = _schedule(manager, req)
    assert [b.block_id for b in new_blocks] == [1, 2, 3]
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)
    manager.check_no_leaks()
    manager.free(req)
    assert manager.num_free_blocks == 10
    assert manager.usage == 0.0
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    assert "a" not in manager.req_to_blocks and "a" not in manager.num_cached_block
    manager.check_no_leaks()


def test_prefix_hit_covers_full_blocks_only():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    _schedule(manager, _request("a", prompt))
    assert len(manager.block_pool.cached_block_hash_to_block) == 2  # the partial block is not

    b = _request("b", prompt)
    hits, num_hit_tokens = _hit(manager, b)
    assert ([h.block_id for h in hits], num_hit_tokens) == ([1, 2], 8)
    assert all(h.ref_cnt == 1 for h in hits)  # lookup alone takes no reference
    (new_blocks,) = manager.allocate_slots(b, 2, (hits,), num_hit_tokens)
    assert [blk.block_id for blk in new_blocks] == [4]
    assert manager.get_block_ids("b") == ([1, 2, 4],)
    assert [h.ref_cnt for h in hits] == [2, 2]  # shared by two running requests
    manager.check_no_leaks()


def test_hit_is_capped_so_the_last_token_is_recomputed():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    _schedule(manager, _request("a", prompt))
    _, num_hit_tokens = manager.get_computed_blocks(_request("b", prompt))
    assert num_hit_tokens == 4  # (8 - 1) // 4 blocks


def test_cache_salt_separates_prefixes():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(10))
    _schedule(manager, _request("a", prompt, cache_salt="tenant-1"))
    assert manager.get_computed_blocks(_request("b", prompt, cache_salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(_request("c", prompt))[1] == 0
    assert manager.get_computed_blocks(_request("d", prompt, cache_salt="tenant-1"))[1] == 8


def test_decode_caches_a_block_once_it_is_full_of_known_tokens():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    req = _request("a", list(range(10)))
    _schedule(manager, req)
    req.num_computed_tokens = 10
    req.append_output_token_ids(100)  # 11 tokens: block 3 still partial
    assert manager.allocate_slots(req, 1) == ([],)
    assert manager.num_cached_block["a"] == 2
    req.num_computed_tokens = 11
    req.append_output_token_ids(101)  # 12 tokens: block 3 full
    assert manager.allocate_slots(req, 1) == ([],)
    assert manager.num_cached_block["a"] == 3
    assert manager.block_pool.get_cached_block(req.block_hashes[2]).block_id == 3
    req.num_computed_tokens = 12
    req.append_output_token_ids(102)  # 13 tokens: needs a fourth block
    assert [b.block_id for b in manager.allocate_slots(req, 1)[0]] == [4]


def test_slots_beyond_the_known_tokens_are_not_cached():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    req = _request("a", list(range(8)))
    # Room for 4 tokens not yet sampled (e.g. speculative): their block has nothing to hash.
    assert len(manager.allocate_slots(req, 12)[0]) == 3
    assert manager.num_cached_block["a"] == 2
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    assert manager.req_to_blocks["a"][0][2].block_hash is None


def test_free_evicts_a_requests_tail_first():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(13))  # 3 full blocks + 1 token
    a = _request("a", prompt)
    _schedule(manager, a)
    manager.free(a)
    # Never-used blocks first, then a's blocks tail first.
    assert _free_ids(manager) == [5, 6, 7, 4, 3, 2, 1]

    other, _ = _schedule(manager, _request("c", list(range(100, 120))))  # 5 blocks
    assert [b.block_id for b in other] == [5, 6, 7, 4, 3]  # evicts a's third block
    # Lazy eviction: block 3's hash is gone, so the lookup stops after a's first two blocks.
    assert manager.block_pool.get_cached_block(a.block_hashes[2]) is None
    hits, num_hit_tokens = _hit(manager, _request("a2", prompt))
    assert ([b.block_id for b in hits], num_hit_tokens) == ([1, 2], 8)


def test_hits_on_free_blocks_are_touched_out_of_the_free_queue():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    a = _request("a", prompt)
    _schedule(manager, a)
    manager.free(a)
    b = _request("b", prompt)
    hits, num_hit_tokens = _hit(manager, b)
    assert [h.ref_cnt for h in hits] == [0, 0]
    manager.allocate_slots(b, 2, (hits,), num_hit_tokens)
    assert [h.ref_cnt for h in hits] == [1, 1]
    assert not set(hits) & set(manager.block_pool.free_block_queue.get_all_free_blocks())
    assert manager.num_free_blocks == 7 - 3
    manager.check_no_leaks()


def test_out_of_blocks_returns_none_without_side_effects():
    manager = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    a = _request("a", list(range(9)))
    _schedule(manager, a)  # 3 blocks, 2 of them cached
    manager.free(a)
    # b hits a's 2 cached (free) blocks and needs 3 more: 3 new would fit in the 4 free blocks,
    # but touching the hits takes 2 of those out of the free queue.
    b = _request("b", list(range(8)) + list(range(100, 112)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    before = (_free_ids(manager), [blk.ref_cnt for blk in manager.block_pool.blocks])
    assert manager.allocate_slots(b, 12, hits, num_hit_tokens) is None
    assert (_free_ids(manager), [blk.ref_cnt for blk in manager.block_pool.blocks]) == before
    assert "b" not in manager.req_to_blocks and "b" not in manager.num_cached_block
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.check_no_leaks()
    # Without the hits it still does not fit: 5 blocks for 20 tokens.
    assert manager.allocate_slots(b, 20) is None
    manager.check_no_leaks()


def test_shared_blocks_stay_in_use_until_the_last_holder_frees():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(10))
    a, b = _request("a", prompt), _request("b", prompt)
    _schedule(manager, a)
    _schedule(manager, b)
    shared = manager.req_to_blocks["a"][0][:2]
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    manager.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    assert manager.num_free_blocks == 10 - 3  # only a's private last block came back
    manager.check_no_leaks()
    manager.free(b)
    assert manager.num_free_blocks == 10
    assert all(blk.ref_cnt == 0 for blk in manager.block_pool.blocks)
    manager.check_no_leaks()


def test_concurrent_identical_prompts_keep_one_cached_copy():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(8))
    a, b = _request("a", prompt), _request("b", prompt)
    assert manager.get_computed_blocks(b)[1] == 0  # looked up before a's blocks are cached
    _schedule(manager, a)
    manager.allocate_slots(b, 8)
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[0]) is manager.req_to_blocks["a"][0][0]
    assert all(blk.block_hash is None for blk in manager.req_to_blocks["b"][0])
    manager.free(a)
    manager.free(b)
    manager.check_no_leaks()


def test_prefix_cache_stats():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(10))
    _schedule(manager, _request("a", prompt))
    _schedule(manager, _request("b", prompt))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(10))
    a = _request("a", prompt)
    _schedule(manager, a)
    assert manager.reset_prefix_cache() is False
    assert manager.get_computed_blocks(_request("b", prompt))[1] == 8
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(_request("c", prompt))[1] == 0


def test_caching_disabled_gives_no_hits():
    manager = KVCacheManager(num_blocks=11, block_size=BS, enable_caching=False)
    prompt = list(range(10))
    _schedule(manager, _request("a", prompt))
    assert manager.get_computed_blocks(_request("b", prompt)) == (([],), 0)
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_prompt_logprobs_skip_the_prefix_cache():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(10))
    _schedule(manager, _request("a", prompt))
    assert manager.get_computed_blocks(_request("b", prompt, prompt_logprobs=1)) == (([],), 0)
    assert manager.get_computed_blocks(_request("c", prompt))[1] == 8


def test_check_no_leaks_catches_a_bad_ref_count():
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    req = _request("a", list(range(4)))
    _schedule(manager, req)
    manager.free(req)
    manager.block_pool.blocks[1].ref_cnt = 1
    with pytest.raises(RuntimeError, match="held by 0 requests"):
        manager.check_no_leaks()


def test_sliding_window_gives_back_blocks_every_later_token_is_past():
    """Window 6, blocks of 4: the token at position p sees keys p - 5 .. p, so block i (keys
    4i .. 4i + 3) goes back once p - 5 > 4i + 3. Its place holds the null block; the freed
    blocks stay cached (a later prompt can still hit them while they are free)."""
    manager = KVCacheManager(num_blocks=11, block_size=BS, groups=[KVCacheGroup(SLIDING, 6, ())])
    req = _request("a", list(range(10)))
    _schedule(manager, req)  # blocks 1, 2, 3 for tokens 0-9
    req.num_computed_tokens = 10
    req.append_output_token_ids(100)
    manager.allocate_slots(req, 1)  # position 10 sees 5..10: block 1 (keys 0-3) is past
    assert manager.get_block_ids("a") == ([0, 2, 3],)
    assert manager.num_free_blocks == 8
    manager.check_no_leaks()
    for p in range(11, 20):
        req.num_computed_tokens = p
        req.append_output_token_ids(100 + p)
        manager.allocate_slots(req, 1)
        held = [b for b in manager.get_block_ids("a")[0] if b]
        assert len(held) <= -(-6 // BS) + 1  # the window's blocks and the one being written
        manager.check_no_leaks()
    assert manager.get_block_ids("a")[0][:3] == [0, 0, 0]  # 19 sees 14..19: blocks 3, 4
    assert manager.block_pool.get_cached_block(req.block_hashes[0]).block_id == 1
    manager.free(req)
    assert manager.num_free_blocks == 10
    manager.check_no_leaks()


def _decode(manager, req, steps):
    for _ in range(steps):
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(7)
        assert manager.allocate_slots(req, 1) is not None
        manager.check_no_leaks()


def test_a_windowed_groups_blocks_return_to_the_pool_as_a_decode_passes_them():
    """A full-attention group and a sliding-window group (window 6) share one pool: the
    full group keeps a block per 4 tokens, the windowed one at most the window's blocks
    and the one being written, so a long decode holds about half what one group would."""
    groups = [KVCacheGroup(FULL, None, (0,)), KVCacheGroup(SLIDING, 6, (1,))]
    manager = KVCacheManager(num_blocks=41, block_size=BS, groups=groups)
    req = _request("a", list(range(10)))
    _schedule(manager, req)
    assert manager.num_free_blocks == 40 - 6  # 3 blocks in each group
    _decode(manager, req, 30)  # 40 tokens: positions 0 .. 39
    full, window = manager.get_block_ids("a")
    assert len(full) == len(window) == 10 and 0 not in full
    assert window[:8] == [0] * 8  # 39 sees 34..39: blocks 8 and 9
    assert manager.num_free_blocks == 40 - 10 - 2
    manager.free(req)
    assert manager.num_free_blocks == 40
    manager.check_no_leaks()


def test_a_hit_is_the_longest_prefix_every_group_serves():
    """Full group: every block of the prefix; sliding group (window 6): only the blocks the
    next token reads, the null block before them. When the window's blocks of the longest
    full hit are gone, the hit shortens to where the windowed group can serve it."""
    groups = [KVCacheGroup(FULL, None, (0,)), KVCacheGroup(SLIDING, 6, (1,))]
    manager = KVCacheManager(num_blocks=41, block_size=BS, groups=groups)
    prompt = list(range(22))  # 5 full blocks + 2 tokens
    a = _request("a", prompt)
    _schedule(manager, a)
    manager.free(a)
    (full, window), n = manager.get_computed_blocks(_request("b", prompt))
    assert n == 20  # the next token (position 20) reads 15..19: blocks 3 and 4
    assert len(full) == 5 and all(not b.is_null for b in full)
    assert [b.is_null for b in window] == [True, True, True, False, False]
    # the sliding group's block 4 is evicted: a hit of 5 blocks would need it, one of 4
    # blocks (next token 16 reads 11..15: blocks 2, 3) is served
    pool = manager.block_pool
    pool._evict(pool.get_cached_block(a.block_hashes[4], 1))
    (full, window), n = manager.get_computed_blocks(_request("c", prompt))
    assert n == 16 and len(full) == 4 and [b.is_null for b in window] == [True, True, False, False]
    b = _request("d", prompt)
    hits, n = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, len(prompt) - n, hits, n) is not None
    manager.check_no_leaks()
    manager.free(b)
    manager.check_no_leaks()


def test_a_trimmed_hit_is_looked_up_again_below_the_cut():
    """A gate cuts the hit (an image it would end inside): the windowed group's blocks are
    those the shorter hit's next token reads, not a slice of the longer hit's."""
    groups = [KVCacheGroup(FULL, None, (0,)), KVCacheGroup(SLIDING, 6, (1,))]
    manager = KVCacheManager(num_blocks=41, block_size=BS, groups=groups)
    prompt = list(range(22))
    _schedule(manager, _request("a", prompt))  # a keeps running: all its blocks cached
    (full, window), n = manager.get_computed_blocks(
        _request("b", prompt), lambda request, n: min(n, 9)
    )
    assert n == 8 and len(full) == len(window) == 2
    assert [b.is_null for b in window] == [False, False]  # 8 reads 3..7: blocks 0, 1
    assert manager.make_prefix_cache_stats().hits == 8  # the hit used is the one reported


def test_chunked_local_attention_keeps_the_current_chunk():
    """Chunks of 8: the token at position p reads keys from 8 * (p // 8) on, so every block
    of an earlier chunk goes back once p enters the next chunk."""
    manager = KVCacheManager(num_blocks=21, block_size=BS, groups=[KVCacheGroup(CHUNKED, 8, ())])
    req = _request("a", list(range(10)))
    _schedule(manager, req)
    _decode(manager, req, 7)  # 17 tokens: position 16 starts the third chunk
    assert manager.get_block_ids("a")[0][:4] == [0, 0, 0, 0]
    manager.free(req)
    manager.check_no_leaks()


def test_layout_groups_layers_of_each_kind_in_equal_groups():
    """vLLM's rule: groups of the fewest layers of any kind (or the most, when the kinds'
    counts are within 25%), padded; full attention's groups first."""
    gemma3_27b = [(SLIDING, 1024)] * 5 + [(FULL, None)]
    layout = group_layers((gemma3_27b * 11)[:62])
    assert layout.num_slots == 10 and [g.kind for g in layout.groups] == [FULL] + [SLIDING] * 6
    assert len(layout.groups[-1].layers) == 2  # 52 = 5 * 10 + 2
    assert layout.place(5)[:2] == (0, 0) and layout.place(0)[:2] == (1, 0)
    gpt_oss = [(SLIDING, 128), (FULL, None)] * 18
    layout = group_layers(gpt_oss)
    assert layout.num_slots == 18 and layout.num_groups == 2
    assert group_layers([(FULL, None)] * 9 + [(SLIDING, 8)] * 10).num_slots == 10  # within 25%
    assert group_layers([(SLIDING, 8)] * 4) == KVCacheLayout.uniform(4, SLIDING, 8)


def test_no_window_keeps_every_block():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    req = _request("a", list(range(10)))
    _schedule(manager, req)
    req.num_computed_tokens = 10
    req.append_output_token_ids(100)
    manager.allocate_slots(req, 1)
    assert manager.get_block_ids("a") == ([1, 2, 3],)


@pytest.mark.parametrize(("kind", "span"), [(FULL, None), (SLIDING, 6), (SLIDING, 9)])
def test_most_blocks_bounds_what_a_chunked_request_holds(kind, span):
    """most_blocks (the engine's admission check): a 50-token request prefilled in chunks of
    8 then decoded holds at most that many blocks of a group at any step, and that many or
    one fewer at some step (the bound is tight)."""
    manager = KVCacheManager(num_blocks=200, block_size=BS, groups=[KVCacheGroup(kind, span, (0,))])
    req = _request("a", list(range(40)))
    most = 0
    for start in range(0, 40, 8):
        req.num_computed_tokens = start
        assert manager.allocate_slots(req, 8) is not None
        most = max(most, 199 - manager.num_free_blocks)
    req.num_computed_tokens = 40
    for token in range(10):
        req.append_output_token_ids(token)
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        most = max(most, 199 - manager.num_free_blocks)
    bound = manager.most_blocks(50, 8)
    assert bound - 1 <= most <= bound
    manager.free(req)
    manager.check_no_leaks()
