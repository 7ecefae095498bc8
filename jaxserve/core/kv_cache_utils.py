"""Prefix-cache block hashes: each full block's hash chains its parent's, so equal hashes mean
equal prefixes (the tokens of every block before it and of itself, the cache salt, and the
content hash of every image whose placeholder tokens the block holds)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    extra_keys: Sequence[str] = (),
) -> BlockHash:
    """sha256 over (parent hash, the block's token ids, salt, extra keys); the salt only
    enters the first block, so it separates whole prefixes (e.g. per tenant); extra_keys: the
    content hashes of the images whose placeholders lie in the block (equal placeholder
    tokens of different images never match)."""
    h = hashlib.sha256(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if parent is None and cache_salt:
        h.update(cache_salt.encode())
    for key in extra_keys:
        h.update(b"\x00mm\x00" + key.encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    mm_features: Sequence = (),
) -> None:
    """Append the hashes of every newly completed full block of token_ids to `hashes`;
    mm_features: the prompt's images (`MultiModalFeature`: offset, length, identifier)."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        end = start + block_size
        keys = [f.identifier for f in mm_features if f.offset < end and f.offset + f.length > start]
        hashes.append(hash_block_tokens(parent, token_ids[start:end], cache_salt, keys))
