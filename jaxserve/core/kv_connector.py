"""What the scheduler calls on a KV connector (vLLM V1's KVConnectorBase_V1, scheduler role).

The connectors live in distributed/kv_transfer (a floor above core); the engine core builds
one and hands it to the Scheduler, which knows it only through this protocol, so core imports
nothing from distributed. kv_transfer/base.py's KVConnectorBase satisfies it (structurally:
it does not inherit from it); its docstring says what each call means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jaxserve.config import KVTransferConfig
    from jaxserve.core.request import Request
    from jaxserve.core.scheduler_output import KVConnectorMetadata
    from jaxserve.ipc.messages import KVConnectorStats


@runtime_checkable
class SchedulerKVConnector(Protocol):
    config: KVTransferConfig  # the scheduler reads its kv_load_failure_policy

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens past the device prefix-cache hit it can supply, whether they come later)."""
        ...

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """The request's blocks exist now (block_ids: all of them)."""
        ...

    def get_finished_recving(self) -> dict[str, int | None]:
        """Asynchronous loads ended since the last call: req_id -> tokens, or None (failed)."""
        ...

    def build_connector_meta(
        self, requests: Sequence[Request], block_ids_of: Callable[[str], list[int]]
    ) -> KVConnectorMetadata:
        """The step's copies for the requests scheduled in it."""
        ...

    def request_finished(self, request: Request) -> dict | None:
        """The request left the engine; returns its response's kv_transfer_params."""
        ...

    def request_preempted(self, request: Request) -> None:
        """The request's blocks were freed by a preemption."""
        ...

    def take_stats(self) -> KVConnectorStats:
        """The counts since the last call (reset by it)."""
        ...


class NoKVConnector:
    """The scheduler's connector when the engine has none: it supplies no tokens, copies
    nothing and reports nothing (so the scheduler never asks whether it has one)."""

    config = None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_computed, num_external) -> None:
        pass

    def get_finished_recving(self) -> dict[str, int | None]:
        return {}

    def build_connector_meta(self, requests, block_ids_of) -> None:
        return None

    def request_finished(self, request: Request) -> None:
        return None

    def request_preempted(self, request: Request) -> None:
        pass

    def take_stats(self) -> None:
        return None
