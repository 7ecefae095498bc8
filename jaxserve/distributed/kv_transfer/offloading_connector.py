"""OffloadingConnector: a host-memory tier under the device prefix cache
(`--kv-offloading-size GiB`, or kv_connector_extra_config {"cpu_bytes_to_use": N}).

Every block that fills with known tokens (prompt and generated) is copied to host memory as
its step is fetched (write-through: the device-to-host copy runs after the step's forward, on
the device's stream, while the host prepares the next step), so when the device's block pool
evicts it, a later request with the same prefix loads it back from the host instead of
recomputing it. The host tier evicts least recently used blocks past its size."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.config import KVTransferConfig
from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.core.request import Request
from jaxserve.distributed.kv_transfer.base import BlockLayout, HostBlockStore, KVConnectorBase


class OffloadingConnector(KVConnectorBase):
    name = "OffloadingConnector"
    saves_generated_blocks = True

    def __init__(self, config: KVTransferConfig, layout: BlockLayout, engine_index: int = 0):
        super().__init__(config, layout, engine_index)
        size = config.kv_connector_extra_config.get("cpu_bytes_to_use")
        if not isinstance(size, int | float) or size < layout.nbytes:
            raise ValueError(
                f"OffloadingConnector: cpu_bytes_to_use={size!r} must hold at least one block "
                f"({layout.nbytes} bytes)"
            )
        self.store = HostBlockStore(int(size), layout.nbytes)

    def should_save(self, request: Request) -> bool:
        return True

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.store

    def read_prefix(self, hashes: Sequence[BlockHash]) -> list[np.ndarray]:
        return self.store.get_prefix(hashes)

    def write(self, hashes: Sequence[BlockHash], blocks: np.ndarray) -> None:
        for block_hash, block in zip(hashes, blocks, strict=True):
            self.store.put(block_hash, block.copy())  # not a view: the batch array can go
