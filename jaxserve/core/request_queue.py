"""The scheduler's waiting queue (vLLM V1's `core/sched/request_queue.py`): first come first
served, or by (priority, arrival) for the "priority" scheduling policy.

A preempted request goes back in with `prepend_request`: first in line under fcfs, by its rank
under priority (it keeps its priority and arrival time, so a heap puts it where it belongs).
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from jaxserve.core.request import Request


class SchedulingPolicy(enum.Enum):
    """SchedulerConfig.policy's values."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """The waiting requests in the order the scheduler admits them."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """A new request (or one back from a grammar compile that was not ready)."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """A request that was already admitted once (preempted, or back from a remote KV load)."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit, left in the queue."""

    @abstractmethod
    def pop_request(self) -> Request:
        """The next request to admit, taken off the queue."""

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Take a request off the queue wherever it is (aborted, or finished while waiting)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in storage order (not necessarily admission order)."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """A deque in arrival order; prepended requests go first."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._requests.append(request)

    def prepend_request(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek_request(self) -> Request:
        return self._requests[0]

    def pop_request(self) -> Request:
        return self._requests.popleft()

    def remove_request(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityRequestQueue(RequestQueue):
    """A heap on (priority, arrival time) (Request.__lt__): lower priority value first."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)  # its rank decides, not its return

    def peek_request(self) -> Request:
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._heap)


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority")."""
    if SchedulingPolicy(policy) is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
