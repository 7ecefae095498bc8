"""The prompt tokens a request wrote to the prefix cache: vLLM's num_cache_creation_tokens,
which the Messages API reports as usage.cache_creation_input_tokens and the Responses API as
usage.input_tokens_details.cache_write_tokens (beside the tokens read from the cache: the
engine's num_cached_tokens)."""

from __future__ import annotations

from jaxserve.config.engine import CacheConfig


def cache_write_tokens(cache: CacheConfig, prompt_tokens: int, cached_tokens: int) -> int:
    """The prompt's tokens in full KV blocks (the engine caches only full blocks, once their
    tokens are computed) less the `cached_tokens` it found there; 0 with prefix caching off.
    An estimate as vLLM's is: a block another request wrote meanwhile counts as written."""
    if not cache.enable_prefix_caching:
        return 0
    full = prompt_tokens // cache.block_size * cache.block_size
    return max(0, full - cached_tokens)
