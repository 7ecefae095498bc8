"""The KV connector API (vLLM V1's KVConnectorBase_V1, both halves in one object: jaxserve's
scheduler and model runner share the engine-core process).

Scheduler side, called by core/scheduler.py (which knows the connector only as
core/kv_connector.py's SchedulerKVConnector protocol, so core does not import this package):
  get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)
      Tokens past the device prefix-cache hit that the connector can supply. Synchronous
      connectors read them now; an asynchronous one (a remote producer) only promises up to
      that many: the request then waits in WAITING_FOR_REMOTE_KVS, off the waiting queue,
      until get_finished_recving() reports what arrived.
  update_state_after_alloc(request, block_ids, num_computed_tokens, num_external_tokens)
      The request's blocks exist now: remember where the loaded blocks go (or start fetching).
  get_finished_recving() -> {req_id: tokens loaded, or None if the load failed}
  build_connector_meta(requests, block_ids_of) -> KVConnectorMetadata
      The step's copies: blocks to load before its forward, blocks to save after it (the
      plain data a SchedulerOutput carries, core/scheduler_output.py).
  request_finished(request) -> kv_transfer_params for the response (or None)
  request_preempted(request); take_stats() -> the step's KVConnectorStats
Worker side, called by worker/model_runner.py (one compiled gather / scatter program per
block-count bucket, worker/kv_block_io.py): the step's loads are scattered into the KV cache
before its forward; its saves are gathered after the forward and handed to save_blocks() once
the step is fetched, before its outputs leave the engine. Copies are per step over all
layers, not per layer as in vLLM: the compiled forward has no host hooks between layers.

Blocks are keyed by the prefix-cache hash of their tokens (core/kv_cache_utils.py), which any
instance computes the same way from the same tokens; a layout fingerprint (model, KV dtype,
block shape) keeps instances of different models apart. A block travels as one array of
[L, block_size, Hkv, K and V widths] in the KV cache's dtype (L: each KV-cache group's layers
at that position, worker/kv_cache.py::block_shape); a position's block id is a tuple of each
group's when the model has several (config/kv_groups.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.config import KVTransferConfig
from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import KVConnectorMetadata
from jaxserve.ipc.messages import KVConnectorStats

logger = logging.getLogger(__name__)

STAT_COUNTS = ("queries", "hits", "loaded_blocks", "saved_blocks", "failed_loads")


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """One block's K and V over every layer, as connectors store it."""

    shape: tuple[int, ...]  # (L, block_size, Hkv, K and V widths: worker/kv_block_io.py)
    dtype: np.dtype
    identity: str  # what else must match between instances: the model and its weights

    @property
    def block_size(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the layout: blocks of another fingerprint never mix."""
        text = f"{self.identity}|{self.shape}|{self.dtype.name}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def from_bytes(self, data: bytes | memoryview) -> np.ndarray:
        return np.frombuffer(data, self.dtype).reshape(self.shape)


class HostBlockStore:
    """Blocks in host memory by hash, least recently used evicted past capacity_bytes;
    thread-safe (a direct connector's server thread reads it)."""

    def __init__(self, capacity_bytes: int, block_nbytes: int):
        self.capacity_blocks = max(0, int(capacity_bytes) // block_nbytes)
        self._blocks: OrderedDict[BlockHash, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: BlockHash, block: np.ndarray) -> None:
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return
            self._blocks[block_hash] = block
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)

    def get_prefix(self, hashes: Sequence[BlockHash]) -> list[np.ndarray]:
        """The blocks of the longest leading run of `hashes` held (marked recently used)."""
        out = []
        with self._lock:
            for h in hashes:
                block = self._blocks.get(h)
                if block is None:
                    break
                self._blocks.move_to_end(h)
                out.append(block)
        return out


class KVConnectorBase:
    """A connector that loads synchronously from a store it can read at once; subclasses
    supply the store (read_prefix / contains / write) and which requests' blocks to save."""

    name = "base"
    saves_generated_blocks = False  # also the blocks of generated tokens (offloading)

    def __init__(self, config: KVTransferConfig, layout: BlockLayout, engine_index: int = 0):
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.engine_index = engine_index
        self.is_producer = config.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = config.kv_role in ("kv_consumer", "kv_both")
        self.stats = KVConnectorStats()
        self._totals = KVConnectorStats()
        self._num_saved: dict[str, int] = {}  # req_id -> leading blocks handed to save
        self._found: dict[str, tuple[int, list[np.ndarray]]] = {}  # req_id -> (first, blocks)
        self._loads: dict[str, list[tuple[int, np.ndarray]]] = {}  # for the next step

    # ------------------------------------------------------------------ the store
    def read_prefix(self, hashes: Sequence[BlockHash]) -> list[np.ndarray]:
        raise NotImplementedError

    def contains(self, block_hash: BlockHash) -> bool:
        raise NotImplementedError

    def write(self, hashes: Sequence[BlockHash], blocks: np.ndarray) -> None:
        """blocks: [n, *layout.shape], one per hash."""
        raise NotImplementedError

    def should_save(self, request: Request) -> bool:
        return self.is_producer

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.is_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0, False
        first, last = self._candidate_blocks(request, num_computed_tokens)
        if last <= first:
            return 0, False
        blocks = self.read_prefix(request.block_hashes[first:last])
        self.stats.queries += (last - first) * self.block_size
        self.stats.hits += len(blocks) * self.block_size
        if not blocks:
            return 0, False
        self._found[request.request_id] = (first, blocks)
        return len(blocks) * self.block_size, False

    def _candidate_blocks(self, request: Request, num_computed_tokens: int) -> tuple[int, int]:
        """The block indices an external load may fill: after the device hit, and never the
        block of the last prompt token (its logits give the first output token)."""
        first = num_computed_tokens // self.block_size
        last = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        return first, last

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """block_ids: all the request's blocks; num_computed_tokens: its device hit."""
        found = self._found.pop(request.request_id, None)
        if not num_external_tokens or found is None:
            return
        first, blocks = found
        n = num_external_tokens // self.block_size
        self._loads[request.request_id] = [(block_ids[first + i], blocks[i]) for i in range(n)]

    def get_finished_recving(self) -> dict[str, int | None]:
        """Asynchronous loads that ended since the last call: req_id -> tokens that arrived,
        or None when the load failed."""
        return {}

    def wait_for_recving(self, timeout: float) -> None:
        """Block up to timeout seconds for an asynchronous load to end (an idle engine)."""

    def build_connector_meta(
        self, requests: Sequence[Request], block_ids_of: Callable[[str], list[int]]
    ) -> KVConnectorMetadata:
        """requests: those scheduled this step, their num_computed_tokens counting it."""
        meta = KVConnectorMetadata()
        for request in requests:
            req_id = request.request_id
            meta.loads.extend(self._loads.pop(req_id, ()))
            if not self.should_save(request):
                continue
            done = self._num_saved.get(req_id, 0)
            end = request.num_computed_tokens
            if not self.saves_generated_blocks:
                end = min(end, request.num_prompt_tokens)
            full = min(end // self.block_size, len(request.block_hashes))
            if full <= done:
                continue
            block_ids = block_ids_of(req_id)
            for i in range(done, full):
                block_hash = request.block_hashes[i]
                if not _given_back(block_ids[i]) and not self.contains(block_hash):
                    meta.saves.append((block_ids[i], block_hash))
            self._num_saved[req_id] = full
        return meta

    def request_finished(self, request: Request) -> dict | None:
        """The request left the engine (finished, aborted or failed): forget it; returns the
        kv_transfer_params its response carries."""
        for state in (self._num_saved, self._found, self._loads):
            state.pop(request.request_id, None)
        return None

    def request_preempted(self, request: Request) -> None:
        """Its blocks are gone: what it saved stays saved, what it was to load is dropped."""
        self._loads.pop(request.request_id, None)

    # ------------------------------------------------------------------ worker side
    def save_blocks(self, hashes: Sequence[BlockHash], blocks: np.ndarray) -> None:
        """The step's saved blocks, [n, *layout.shape] on the host, before its outputs go."""
        self.write(hashes, blocks)
        self.stats.saved_blocks += len(hashes)

    def note_loaded(self, num_blocks: int) -> None:
        self.stats.loaded_blocks += num_blocks

    def take_stats(self) -> KVConnectorStats:
        """The counts since the last call (the scheduler's stats of each step); resets them."""
        stats, self.stats = self.stats, KVConnectorStats()
        stats.connector = self.name
        stats.block_bytes = self.layout.nbytes
        for field in STAT_COUNTS:
            setattr(self._totals, field, getattr(self._totals, field) + getattr(stats, field))
        return stats

    def totals(self) -> KVConnectorStats:
        """The counts since start-up."""
        out = KVConnectorStats(self.name, block_bytes=self.layout.nbytes)
        for field in STAT_COUNTS:
            setattr(out, field, getattr(self._totals, field) + getattr(self.stats, field))
        return out

    def shutdown(self) -> None:
        pass


def _given_back(block_id) -> bool:
    """A position a window gave back (in any KV-cache group): the null block, 0, holds it."""
    return block_id == 0 if isinstance(block_id, int) else 0 in block_id
