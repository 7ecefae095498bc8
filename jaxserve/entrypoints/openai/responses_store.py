"""The in-memory store of /v1/responses (JAXSERVE_ENABLE_RESPONSES_API_STORE, vLLM's
VLLM_ENABLE_RESPONSES_API_STORE): what `previous_response_id` continues and
GET /v1/responses/{id} returns. vLLM's grows without bound; this one keeps at most
MAX_STORED_RESPONSES entries and MAX_STORED_RESPONSE_BYTES bytes of their JSON, evicting the
least recently used (read or written) first. One process's memory: with --api-server-count
above 1 each API server has its own, so a continuation may land on a server that lacks it (a
404)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import msgspec

logger = logging.getLogger("jaxserve.api_server")

MAX_STORED_RESPONSES = 10_000
MAX_STORED_RESPONSE_BYTES = 256 * 2**20  # the entries' JSON (the conversation and response)


class StoredResponse(msgspec.Struct):
    response: Any  # a ResponsesResponse
    history: list[dict[str, Any]]  # the input items before the response's output, in order


class ResponsesStore:
    """id -> StoredResponse, LRU-bounded in entries and in bytes; thread-safe (requests are
    prepared on the tokenizer thread, saved on the event loop)."""

    def __init__(
        self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_RESPONSE_BYTES
    ):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, entry: StoredResponse) -> None:
        size = len(msgspec.json.encode(entry))
        if size > self.max_bytes:
            logger.warning("response %s (%d bytes) exceeds the store's %d bytes: not stored",
                           response_id, size, self.max_bytes)  # fmt: skip
            return
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[response_id] = (entry, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._entries.get(response_id)
            if found is None:
                return None
            self._entries.move_to_end(response_id)
            return found[0]
