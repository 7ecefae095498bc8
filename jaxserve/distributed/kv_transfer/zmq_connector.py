"""ZmqConnector: KV blocks straight from a prefill instance's memory to a decode instance's,
over ZeroMQ (TCP), no disk. jaxserve's own direct connector, in the place of vLLM's
NixlConnector, and driven by the same kv_transfer_params:

1. The proxy sends the prompt to the producer with kv_transfer_params {"do_remote_decode":
   true} and max_tokens 1. The producer computes it; as each step is fetched it copies the
   prompt's full blocks to host memory (a HostBlockStore of kv_buffer_size bytes, oldest
   dropped first) and its response's kv_transfer_params say where to fetch them:
   {"do_remote_prefill": true, "remote_host": kv_ip, "remote_port": kv_port + engine index,
   "remote_engine_id": ...}. A ROUTER socket on that port serves them.
2. The proxy sends the request on to the consumer with those kv_transfer_params. Its
   scheduler allocates the prompt's blocks (all but the block of the last token) and parks
   the request in WAITING_FOR_REMOTE_KVS; a fetch thread asks the producer for the blocks by
   hash (the consumer hashes the same tokens the same way) and gets back the longest
   leading run it holds, one frame per block. The next step scatters them into the KV cache
   and the request runs, computing only what did not come.
3. No answer within kv_connector_extra_config.timeout_s (default 5; the producer died, say):
   the request recomputes its prompt (kv_load_failure_policy "recompute") or fails ("fail").

The transfer is device -> host numpy -> ZeroMQ frames -> host numpy -> device: one host copy
each side, no device-to-device path (jax's transfer API needs both ends in one jax process
group; DLPack is an in-process exchange)."""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import zmq

from jaxserve.config import KVTransferConfig
from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.core.request import Request
from jaxserve.distributed.kv_transfer.base import BlockLayout, HostBlockStore, KVConnectorBase

logger = logging.getLogger(__name__)


class BlockQuery(msgspec.Struct, array_like=True):
    fingerprint: str
    hashes: list[bytes]


class BlockReply(msgspec.Struct, array_like=True):
    num_blocks: int  # this many block frames follow
    error: str | None = None


class ZmqConnector(KVConnectorBase):
    name = "ZmqConnector"

    def __init__(self, config: KVTransferConfig, layout: BlockLayout, engine_index: int = 0):
        super().__init__(config, layout, engine_index)
        extra = config.kv_connector_extra_config
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.port = config.kv_port + engine_index
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._done: queue.SimpleQueue[tuple[str, list[np.ndarray] | None]] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self._fetching: dict[str, list[int]] = {}  # req_id -> block ids the blocks go to
        self._fetch_pool = ThreadPoolExecutor(4, thread_name_prefix="kv-fetch")
        self.store = None
        if self.is_producer:
            self.store = HostBlockStore(int(config.kv_buffer_size), layout.nbytes)
            server = self._ctx.socket(zmq.ROUTER)
            server.setsockopt(zmq.LINGER, 0)
            try:
                server.bind(f"tcp://{config.kv_ip}:{self.port}")
            except zmq.ZMQError as e:
                server.close()
                raise ValueError(
                    f"ZmqConnector: cannot serve KV on {config.kv_ip}:{self.port} ({e}); set "
                    "kv_transfer_config kv_ip / kv_port"
                ) from None
            self._server = threading.Thread(
                target=self._serve, args=(server,), daemon=True, name="kv-server"
            )
            self._server.start()
            logger.info("ZmqConnector serves KV blocks on %s:%d", config.kv_ip, self.port)

    # ------------------------------------------------------------------ producer
    def should_save(self, request: Request) -> bool:
        return self.is_producer and bool((request.kv_transfer_params or {}).get("do_remote_decode"))

    def contains(self, block_hash: BlockHash) -> bool:
        return self.store is not None and block_hash in self.store

    def write(self, hashes: Sequence[BlockHash], blocks: np.ndarray) -> None:
        for block_hash, block in zip(hashes, blocks, strict=True):
            self.store.put(block_hash, block.copy())

    def _serve(self, sock: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(BlockQuery)
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = sock.recv_multipart()
            try:
                query = decoder.decode(frames[0])
            except (msgspec.DecodeError, IndexError) as e:
                sock.send_multipart([ident, encoder.encode(BlockReply(0, f"bad query: {e}"))])
                continue
            if query.fingerprint != self.layout.fingerprint:
                error = (
                    f"KV layout {query.fingerprint} asked of a producer of "
                    f"{self.layout.fingerprint} (another model, dtype or block size)"
                )
                sock.send_multipart([ident, encoder.encode(BlockReply(0, error))])
                continue
            # As bytes: bfloat16 (an ml_dtypes type) has no buffer-protocol format.
            blocks = [b.view(np.uint8) for b in self.store.get_prefix(query.hashes)]
            sock.send_multipart(
                [ident, encoder.encode(BlockReply(len(blocks))), *blocks], copy=False
            )
        sock.close()

    def request_finished(self, request: Request) -> dict | None:
        super().request_finished(request)
        self._fetching.pop(request.request_id, None)
        if not self.should_save(request):
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": None,
            "remote_host": self.config.kv_ip,
            "remote_port": self.port,
        }

    # ------------------------------------------------------------------ consumer
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if (
            not self.is_consumer
            or not params.get("do_remote_prefill")
            or not params.get("remote_host")
            or not params.get("remote_port")
            or request.sampling_params.prompt_logprobs is not None
        ):
            return 0, False
        first, last = self._candidate_blocks(request, num_computed_tokens)
        if last <= first:
            return 0, False
        self.stats.queries += (last - first) * self.block_size
        return (last - first) * self.block_size, True

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        if not num_external_tokens:
            return
        first = num_computed_tokens // self.block_size
        n = num_external_tokens // self.block_size
        self._fetching[request.request_id] = block_ids[first : first + n]
        params = request.kv_transfer_params  # checked by the frontend (kv_transfer/params.py)
        host = params["remote_host"]
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        address = f"tcp://{host}:{params['remote_port']}"
        hashes = request.block_hashes[first : first + n]
        self._fetch_pool.submit(self._fetch, request.request_id, address, hashes)

    def _fetch(self, req_id: str, address: str, hashes: list[BlockHash]) -> None:
        blocks = None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(address)
            sock.send(msgspec.msgpack.encode(BlockQuery(self.layout.fingerprint, hashes)))
            if not sock.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"no answer from {address} in {self.timeout_s} s")
            frames = sock.recv_multipart(copy=False)
            reply = msgspec.msgpack.decode(frames[0].buffer, type=BlockReply)
            if reply.error:
                raise RuntimeError(reply.error)
            blocks = [self.layout.from_bytes(f.buffer) for f in frames[1 : 1 + reply.num_blocks]]
        except Exception as e:  # the request recomputes (or fails): never lost
            logger.warning("request %s: KV from %s not loaded: %s", req_id, address, e)
        finally:
            sock.close()
        self._done.put((req_id, blocks))
        self._arrived.set()

    def get_finished_recving(self) -> dict[str, int | None]:
        finished: dict[str, int | None] = {}
        while True:
            try:
                req_id, blocks = self._done.get_nowait()
            except queue.Empty:
                return finished
            block_ids = self._fetching.pop(req_id, None)
            if block_ids is None:  # aborted while fetching
                continue
            if blocks is None:
                self.stats.failed_loads += 1
                finished[req_id] = None
                continue
            self._loads[req_id] = list(zip(block_ids, blocks, strict=False))
            self.stats.hits += len(blocks) * self.block_size
            finished[req_id] = len(blocks) * self.block_size

    def wait_for_recving(self, timeout: float) -> None:
        if self._arrived.wait(timeout):
            self._arrived.clear()

    def shutdown(self) -> None:
        self._stop.set()
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        if self.is_producer:
            self._server.join(timeout=1)
        self._ctx.destroy(linger=0)
