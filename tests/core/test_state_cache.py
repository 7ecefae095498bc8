"""The hybrid models' state slots on the scheduler's side (core/state_cache.py): a state
saved in a step is found from the next one, the least recently used slot is reused first,
and a hit is cut back to the longest prefix with a kept state."""

from types import SimpleNamespace

from jaxserve.core.state_cache import StateCache


def request(hashes: list[bytes], block_size: int = 4):
    return SimpleNamespace(block_hashes=hashes, block_size=block_size)


def test_saved_states_are_found_from_the_next_step_and_reused_least_recent_first():
    cache = StateCache(2)
    a, b, c = b"a", b"b", b"c"
    assert cache.reserve(a) == 0 and cache.reserve(a) is None  # once per hash
    assert cache.longest_hit(request([a]), 4) == 0  # copied after this step's forward
    cache.begin_step()
    assert cache.longest_hit(request([a]), 4) == 4
    assert cache.reserve(b) == 1
    cache.begin_step()
    cache.take(a)  # a restored: b is now the least recently used
    assert cache.reserve(c) == 1
    cache.begin_step()
    assert cache.longest_hit(request([b"x", b]), 8) == 0
    assert cache.longest_hit(request([b"x", c, b"y"]), 12) == 8  # cut back to c's block
    cache.reset()
    assert cache.longest_hit(request([a]), 4) == 0 and cache.reserve(b) == 0
