"""The scheduler's requests whose KV comes from another instance (a KV connector in a
consumer role, distributed/kv_transfer): parked off the waiting queue, holding their blocks,
until the connector says the KV arrived (or failed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from collections.abc import Callable

    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.kv_connector import SchedulerKVConnector
    from jaxserve.core.request_queue import RequestQueue
    from jaxserve.ipc.messages import EngineCoreOutput


class RemoteKVLoads:
    """The Scheduler's methods that park and release requests waiting for remote KV."""

    kv_cache_manager: KVCacheManager
    connector: SchedulerKVConnector  # (core/kv_connector.py's NoKVConnector: none)
    waiting: RequestQueue
    waiting_for_remote: dict[str, Request]
    pending_outputs: list[EngineCoreOutput]
    _fail: Callable[[Request, Exception], EngineCoreOutput]  # finishes it with the error

    def _wait_for_remote(
        self, request: Request, computed_blocks: list, num_computed: int, num_external: int
    ) -> bool:
        """Give a waiting request the blocks for its device hit and the KV another instance
        will send, and park it until the KV arrives; False if the blocks do not fit."""
        kv = self.kv_cache_manager
        new_blocks = kv.allocate_slots(
            request, num_external, computed_blocks, num_computed, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        self.waiting.pop_request()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_computed
        self.waiting_for_remote[request.request_id] = request
        self.connector.update_state_after_alloc(
            request, kv.get_block_ids(request.request_id), num_computed, num_external
        )
        return True

    def _finish_remote_loads(self) -> None:
        """Requests whose remote KV arrived rejoin the front of the waiting queue with it
        counted as computed (a partial or failed load leaves the rest to compute); a failed
        load under kv_load_failure_policy "fail" finishes the request with an error. If the
        connector cannot say, every request waiting for remote KV fails."""
        try:
            finished = self.connector.get_finished_recving()
        except Exception as e:
            for request in list(self.waiting_for_remote.values()):
                self.pending_outputs.append(self._fail(request, e))
            return
        for req_id, loaded in finished.items():
            request = self.waiting_for_remote.get(req_id)
            if request is None:
                continue
            if loaded is None and self.connector.config.kv_load_failure_policy == "fail":
                error = RuntimeError("its KV could not be loaded from the prefill instance")
                self.pending_outputs.append(self._fail(request, error))
                continue
            if not isinstance(loaded, int | None) or not 0 <= (loaded or 0) <= request.num_tokens:
                error = RuntimeError(f"the KV connector loaded {loaded!r} tokens")
                self.pending_outputs.append(self._fail(request, error))
                continue
            del self.waiting_for_remote[req_id]
            request.num_computed_tokens += loaded or 0
            request.status = RequestStatus.WAITING
            self.waiting.prepend_request(request)
