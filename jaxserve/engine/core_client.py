"""How the frontend talks to the engine core.

`EngineCoreClient` is the surface (add, abort, get the next outputs, utility calls);
`InprocClient` holds the EngineCore in the caller's process and steps it on `get_output()`. It is
kept for tests and debugging once the multi-process clients exist: same calls, no sockets.
"""

from __future__ import annotations

import abc
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore
from jaxserve.ipc.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(abc.ABC):
    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (empty when the core has nothing to do)."""

    @abc.abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run an EngineCore method (e.g. "reset_prefix_cache") and return its result."""

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:  # noqa: B027 (nothing to release in-process)
        pass


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig):
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        if method.startswith("_") or not callable(getattr(self.engine_core, method, None)):
            raise ValueError(f"EngineCore has no utility method {method!r}")
        return getattr(self.engine_core, method)(*args)
