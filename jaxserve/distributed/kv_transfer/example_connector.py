"""ExampleConnector (vLLM's, formerly SharedStorageConnector): each block a file named by its
hash under `kv_connector_extra_config.shared_storage_path`/<layout fingerprint>/. For tests
and simple setups where both instances see one filesystem; a file appears whole or not at
all (written aside, then renamed)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxserve.config import KVTransferConfig
from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.distributed.kv_transfer.base import BlockLayout, KVConnectorBase


class ExampleConnector(KVConnectorBase):
    name = "ExampleConnector"

    def __init__(self, config: KVTransferConfig, layout: BlockLayout, engine_index: int = 0):
        super().__init__(config, layout, engine_index)
        root = config.kv_connector_extra_config.get("shared_storage_path")
        if not root:
            raise ValueError(
                f"kv_transfer_config: {config.kv_connector} needs kv_connector_extra_config "
                '{"shared_storage_path": DIR}'
            )
        self.dir = Path(root) / layout.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}.kv"

    def contains(self, block_hash: BlockHash) -> bool:
        return self._path(block_hash).exists()

    def read_prefix(self, hashes: Sequence[BlockHash]) -> list[np.ndarray]:
        blocks = []
        for block_hash in hashes:
            try:
                data = self._path(block_hash).read_bytes()
            except FileNotFoundError:
                break
            if len(data) != self.layout.nbytes:  # not ours to trust
                break
            blocks.append(self.layout.from_bytes(data))
        return blocks

    def write(self, hashes: Sequence[BlockHash], blocks: np.ndarray) -> None:
        for block_hash, block in zip(hashes, blocks, strict=True):
            path = self._path(block_hash)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(np.ascontiguousarray(block).tobytes())
            os.replace(tmp, path)
