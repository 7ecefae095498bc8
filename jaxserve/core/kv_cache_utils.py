"""Prefix-cache block hashes: each full block's hash chains its parent's, so equal hashes mean
equal prefixes (the tokens of every block before it and of itself, and the cache salt)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None
) -> BlockHash:
    """sha256 over (parent hash, the block's token ids, salt); the salt only enters the first
    block, so it separates whole prefixes (e.g. per tenant)."""
    h = hashlib.sha256(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if parent is None and cache_salt:
        h.update(cache_salt.encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> None:
    """Append the hashes of every newly completed full block of token_ids to `hashes`."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], cache_salt))
