"""The model runner over several hosts (distributed/multihost.py has the cluster and the call
channel): rank 0's runner is a `BroadcastRunner`, which sends each call that runs on the
devices to the follower ranks before making it, and each follower (`run_follower`, the process
`jaxserve serve --headless` starts on the other hosts) makes the same call on its own runner,
so every rank runs the same programs in the same order on the same host inputs and keeps the
same input batch. Only rank 0's results leave. The KV cache gets the fewest blocks that fit
on any rank's devices: each follower sizes its own as it joins.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from jaxserve.distributed.multihost import FollowerChannel, Leader, initialize, leave_cluster
from jaxserve.startup import StartupTimeline
from jaxserve.worker.build import build_runner
from jaxserve.worker.step_types import PendingStep

logger = logging.getLogger(__name__)


class _StepRef:
    """A PendingStep in a call message: the follower's own PendingStep of that step."""

    def __init__(self, step: int):
        self.step = step


class BroadcastRunner:
    """Rank 0's ModelRunner (the Runner protocol, worker/runner_protocol.py): every call that
    runs programs on the devices, or decides what later ones run, goes to the followers first
    (a PendingStep argument as the number of the step that made it), then runs here; the rest
    run here alone."""

    def __init__(self, runner: Any, leader: Leader):
        self._runner = runner
        self._leader = leader
        self._steps = itertools.count()
        self._step_of: dict[int, int] = {}  # id(PendingStep) -> its step number
        leader.wait_for_followers()

    def determine_num_blocks(self) -> int:
        """The fewest KV blocks that fit on any rank's devices (each follower sized its own
        when it joined)."""
        return min(self._runner.determine_num_blocks(), *self._leader.follower_blocks.values())

    # ------------------------------------------------------------------ rank 0 alone
    @property
    def num_blocks(self) -> int:
        return self._runner.num_blocks

    def compile_status(self) -> tuple[int, int]:
        return self._runner.compile_status()

    def max_step_tokens(self) -> int:
        return self._runner.max_step_tokens()

    def ready_token_buckets(self) -> list[int]:
        return self._runner.ready_token_buckets()

    def kv_bytes_per_block(self) -> int:
        return self._runner.kv_bytes_per_block()

    def add_lora(self, request, live) -> None:
        self._runner.add_lora(request, live)  # (LoRA over several hosts: refused at start-up)

    def remove_lora(self, lora_int_id: int, live: set[int]) -> None:
        self._runner.remove_lora(lora_int_id, live)

    def encoder_cache_spec(self):
        return self._runner.encoder_cache_spec()

    def check_images(self, features: list) -> None:
        self._runner.check_images(features)

    def kv_layout(self):
        return self._runner.kv_layout()

    def set_kv_connector(self, connector) -> None:
        self._runner.set_kv_connector(connector)

    def device_state(self):
        return self._runner.device_state()  # (sleep over several hosts: refused before)

    # ------------------------------------------------------------------ every rank
    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast("initialize_kv_cache", num_blocks)

    def compile_all(self, background: bool = False) -> None:
        self._broadcast("compile_all", background=background)

    def dispatch(self, so):
        return self._broadcast("dispatch", so)

    def dispatch_sample(self, pending, bitmask):
        return self._broadcast("dispatch_sample", pending, bitmask)

    def fetch(self, pending):
        return self._broadcast("fetch", pending)

    def dummy_step(self) -> None:
        self._broadcast("dummy_step")

    def _broadcast(self, name: str, *args, **kwargs):
        """Send the call to the followers (a PendingStep as its step number), then make it."""
        method = getattr(self._runner, name)
        refs = tuple(
            _StepRef(self._step_of.pop(id(a))) if isinstance(a, PendingStep) else a for a in args
        )
        if name == "fetch" and self._runner.followers_need_sampled:
            # a pipeline whose last stage is rank 0's: its fetch runs no program, and the
            # other ranks take the step's sampled tokens from it (pipeline_stages.py)
            result = method(*args, **kwargs)
            sampled = {"sampled": result.sampled_token_ids}
            self._leader.send((name, refs, {**kwargs, **sampled}, None))
            return result
        step = next(self._steps) if name in ("dispatch", "dispatch_sample") else None
        self._leader.send((name, refs, kwargs, step))
        result = method(*args, **kwargs)
        if step is not None and result is not None:
            self._step_of[id(result)] = step
        return result


def run_follower(args: Any) -> int:
    """A follower rank (`jaxserve serve --headless --node-rank R`, R > 0): join the cluster,
    load the same model, then make every call rank 0 sends on its own runner until rank 0
    ends (0) or is lost (1: the channel exits the process)."""
    rank = args.node_rank
    initialize(args.nnodes, rank, args.master_addr, args.master_port)
    config = args.create_engine_config()
    runner = build_runner(config, StartupTimeline())
    try:  # what fits on this rank's devices: rank 0 sizes the cache for the fewest
        num_blocks: int | str = runner.determine_num_blocks()
    except ValueError as e:
        num_blocks = str(e)
    channel = FollowerChannel(rank, args.master_addr, args.master_port)
    channel.ready(num_blocks)
    pending: dict[int, Any] = {}
    while True:
        name, refs, kwargs, step = channel.recv()
        if name == "shutdown":
            logger.info("rank 0 ended: follower rank %d exits", rank)
            leave_cluster()
            return 0
        call_args = [pending.pop(a.step) if isinstance(a, _StepRef) else a for a in refs]
        result = getattr(runner, name)(*call_args, **kwargs)
        if step is not None and result is not None:
            pending[step] = result
