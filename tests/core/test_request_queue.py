"""The waiting queue's order under each scheduling policy."""

import pytest

from jaxserve.core.request import Request
from jaxserve.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from jaxserve.sampling_params import SamplingParams


def req(req_id, *, priority=0, arrival=0.0):
    return Request(req_id, [1, 2, 3], SamplingParams(), eos_token_id=None, block_size=4,
                   arrival_time=arrival, priority=priority)  # fmt: skip


def drain(queue):
    return [queue.pop_request().request_id for _ in range(len(queue))]


def test_the_policy_picks_the_queue():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError, match="lifo"):
        create_request_queue("lifo")


def test_fcfs_serves_in_arrival_order_and_a_prepended_request_first():
    queue = create_request_queue("fcfs")
    assert not queue and len(queue) == 0
    a, b, c, d = req("a", priority=5), req("b"), req("c"), req("d")
    for r in (a, b, c):
        queue.add_request(r)
    queue.prepend_request(d)  # preempted: first in line whatever its priority
    assert queue and queue.peek_request() is d and len(queue) == 4
    queue.remove_request(b)
    assert [r.request_id for r in queue] == ["d", "a", "c"]
    assert drain(queue) == ["d", "a", "c"] and not queue


def test_priority_serves_by_priority_then_arrival_and_a_prepended_request_by_its_rank():
    queue = create_request_queue("priority")
    late_urgent = req("late_urgent", priority=-1, arrival=9.0)
    for r in (req("b", arrival=2.0), req("a", arrival=1.0), late_urgent, req("z", priority=3)):
        queue.add_request(r)
    assert queue.peek_request() is late_urgent
    queue.prepend_request(req("back", priority=0, arrival=1.5))  # between a and b
    queue.remove_request(late_urgent)  # the heap stays ordered
    assert sorted(r.request_id for r in queue) == ["a", "b", "back", "z"]
    assert drain(queue) == ["a", "back", "b", "z"]
