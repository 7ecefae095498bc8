"""The scheduler's requests whose KV comes from another instance (a KV connector in a
consumer role, distributed/kv_transfer): parked off the waiting queue, holding their blocks,
until the connector says the KV arrived (or failed). `RemoteKVLoads` owns them."""

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
    """The parked requests (`requests`, by id) of one scheduler."""

    def __init__(self, kv_cache_manager: KVCacheManager, waiting: RequestQueue):
        """waiting: the scheduler's queue (a request leaves it to park, and rejoins its
        front)."""
        self.kv_cache_manager, self.waiting = kv_cache_manager, waiting
        self.requests: dict[str, Request] = {}

    def park(
        self,
        connector: SchedulerKVConnector,
        request: Request,
        computed_blocks: tuple,
        num_computed: int,
        num_external: int,
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
        self.requests[request.request_id] = request
        connector.update_state_after_alloc(
            request, kv.connector_block_ids(request.request_id), num_computed, num_external
        )
        return True

    def finish(
        self,
        connector: SchedulerKVConnector,
        fail: Callable[[Request, Exception], EngineCoreOutput],
    ) -> list[EngineCoreOutput]:
        """Requests whose remote KV arrived rejoin the front of the waiting queue with it
        counted as computed (a partial or failed load leaves the rest to compute); a failed
        load under kv_load_failure_policy "fail" finishes the request with an error. If the
        connector cannot say, every parked request fails. fail: finishes a request with an
        error (the scheduler's; passed, not kept: no reference cycle). Returns the failed
        ones' outputs."""
        try:
            finished = connector.get_finished_recving()
        except Exception as e:
            return [fail(request, e) for request in list(self.requests.values())]
        failed = []
        for req_id, loaded in finished.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            if loaded is None and connector.config.kv_load_failure_policy == "fail":
                error = RuntimeError("its KV could not be loaded from the prefill instance")
                failed.append(fail(request, error))
                continue
            if not isinstance(loaded, int | None) or not 0 <= (loaded or 0) <= request.num_tokens:
                error = RuntimeError(f"the KV connector loaded {loaded!r} tokens")
                failed.append(fail(request, error))
                continue
            del self.requests[req_id]
            request.num_computed_tokens += loaded or 0
            request.status = RequestStatus.WAITING
            self.waiting.prepend_request(request)
        return failed
