"""The in-memory store of /v1/responses (JAXSERVE_ENABLE_RESPONSES_API_STORE, vLLM's
VLLM_ENABLE_RESPONSES_API_STORE): what `previous_response_id` continues and
GET /v1/responses/{id} returns. vLLM's grows without bound; this one keeps at most
MAX_STORED_RESPONSES entries and JAXSERVE_RESPONSES_STORE_MAX_BYTES bytes (256 MiB by default),
evicting the least recently used (read or written) first. One process's memory: with
--api-server-count above 1 each API server has its own, so a continuation may land on a server
that lacks it (a 404).

An entry is held as its JSON bytes and decoded when read, so what it is counted for is what
it holds: one bytes object (`entry_size`). Held as Python objects, a body of 1.4 M empty
objects (`{}`: 3 bytes of JSON each) took over 20x its JSON's size, and a cap on JSON bytes
did not bound the memory (issue 64)."""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from typing import Any

import msgspec

from jaxserve import envs
from jaxserve.entrypoints.openai.protocol_responses import ResponsesResponse

logger = logging.getLogger("jaxserve.api_server")

MAX_STORED_RESPONSES = 10_000
# An entry's cost beyond its bytes object: its id (a str of ~40 chars, ~90 bytes), the
# OrderedDict's slot and link (~100) and the (bytes, size) tuple (~56).
ENTRY_OVERHEAD = 256


class StoredResponse(msgspec.Struct):
    response: ResponsesResponse
    history: list[dict[str, Any]]  # the input items before the response's output, in order


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(StoredResponse).decode


def entry_size(response_id: str, blob: bytes) -> int:
    """What an entry held as `blob` takes: the bytes object (its header and its data) and
    ENTRY_OVERHEAD."""
    return sys.getsizeof(blob) + len(response_id) + ENTRY_OVERHEAD


class ResponsesStore:
    """id -> StoredResponse (held as JSON), LRU-bounded in entries and in bytes; thread-safe
    (requests are prepared on the tokenizer thread, saved on the event loop)."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int | None = None):
        """max_bytes: None reads JAXSERVE_RESPONSES_STORE_MAX_BYTES."""
        self.max_entries = max_entries
        self.max_bytes = envs.JAXSERVE_RESPONSES_STORE_MAX_BYTES if max_bytes is None else max_bytes
        self._entries: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """What the entries hold, in bytes (each as `entry_size`)."""
        return self._bytes

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep `entry` (as its JSON); one larger than the whole store, or that cannot be
        encoded, is not kept (a warning): the response was answered all the same."""
        try:
            # a copy: the encoder's own output may keep a larger buffer than its length (up
            # to ~1.3x measured), which the count would not see
            blob = bytes(memoryview(_encode(entry)))
        except (TypeError, ValueError, OverflowError) as e:
            logger.warning("response %s cannot be stored: %s", response_id, e)
            return
        size = entry_size(response_id, blob)
        if size > self.max_bytes:
            logger.warning(
                "response %s (%d bytes) exceeds the store's %d bytes: not stored",
                response_id,
                size,
                self.max_bytes,
            )
            return
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[response_id] = (blob, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, decoded afresh (the caller's to keep or change), or None."""
        with self._lock:
            found = self._entries.get(response_id)
            if found is None:
                return None
            self._entries.move_to_end(response_id)
        return _decode(found[0])
