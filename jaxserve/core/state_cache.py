"""Prefix caching for hybrid models (Qwen3-Next, Qwen3.5): their linear-attention layers keep
one state per request, not per block, so a prefix-cache hit is only usable where the state
after that prefix was kept too (vLLM's `--mamba-cache-mode align`, in slots of its own).

  which states   one per request: after the last block boundary before its prompt's end
                 (B = the largest multiple of block_size below its token count, at
                 admission). Its prefill is split so that one step ends exactly at B (the
                 state exists only at the end of a step's chunk), and the runner copies that
                 row's state into a slot after the step (worker/state_slots.py). A later
                 request sharing the prefix up to B (the same system prompt, the next turn of
                 a chat) restores it and computes from B on
  the pool       as many slots as max_num_seqs, beside the input-batch rows' states (each a
                 state of every linear layer: their memory comes off the KV budget); least
                 recently used slot reused first. A slot is keyed by the hash of the block
                 ending at B, which chains the whole prefix
  a hit          the KV manager's block hit, cut back to the longest prefix whose last block
                 has a state; a state saved in a step is found from the next step on (it is
                 copied after that step's forward)

The gate wraps the scheduler's other gate (core/scheduler_gates.py) and passes each call on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from jaxserve.core.request import Request
from jaxserve.core.scheduler_gates import EncoderGate, NoEncoderGate

if TYPE_CHECKING:
    from jaxserve.core.encoder_cache_manager import EncoderCacheManager
    from jaxserve.core.kv_cache_manager import KVCacheManager


class StateCache:
    """Which block hash each state slot holds (least recently used first)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()
        self.saving: dict[bytes, int] = {}  # reserved this step: findable from the next one
        self.free = list(range(num_slots - 1, -1, -1))

    def longest_hit(self, request: Request, num_tokens: int) -> int:
        """The longest prefix of the request's first num_tokens (a multiple of its block size)
        whose state is kept: a multiple of the block size, 0 for none."""
        hashes = request.block_hashes
        for n in range(num_tokens // request.block_size, 0, -1):
            if hashes[n - 1] in self.slot_of:
                return n * request.block_size
        return 0

    def take(self, block_hash: bytes) -> int:
        """The slot holding the state of the prefix ending with block_hash (now the most
        recently used)."""
        self.slot_of.move_to_end(block_hash)
        return self.slot_of[block_hash]

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for the state after the block `block_hash` (the least recently used one
        when none is free); None when it is kept or being saved already."""
        if block_hash in self.slot_of or block_hash in self.saving:
            return None
        if self.free:
            slot = self.free.pop()
        elif self.slot_of:
            _, slot = self.slot_of.popitem(last=False)
        else:
            return None  # every slot is being saved this step
        self.saving[block_hash] = slot
        return slot

    def begin_step(self) -> None:
        """The previous step's saves are in their slots (copied after its forward, before
        anything of this step)."""
        self.slot_of.update(self.saving)
        self.saving.clear()

    def reset(self) -> None:
        """Forget every state (the prefix cache was reset)."""
        self.slot_of.clear()
        self.saving.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))


class StateGate:
    """The scheduler's gate for a hybrid model with prefix caching: a hit cut back to a kept
    state, the prefill aligned on its state boundary, and the step's copies (restore a slot
    into a newly admitted request's row; save a row into a slot after the step)."""

    def __init__(self, inner: EncoderGate, cache: StateCache):
        self.inner, self.cache = inner, cache
        self.boundary: dict[str, int] = {}  # request -> position whose state it saves
        self.admitted: set[str] = set()  # requests whose row holds their state
        self.restores: dict[str, int] = {}  # this step's: request -> slot into its row
        self.saves: dict[str, int] = {}  # request -> slot its row goes to after the step

    def begin_step(self) -> None:
        self.inner.begin_step()
        self.cache.begin_step()

    def _boundary(self, request: Request) -> int:
        rid = request.request_id
        if rid not in self.boundary:
            size = request.block_size
            self.boundary[rid] = (request.num_tokens - 1) // size * size
        return self.boundary[rid]

    def trim_hit(self, request: Request, num_computed: int) -> int:
        return self.cache.longest_hit(request, self.inner.trim_hit(request, num_computed))

    def plan(self, request: Request, start: int, num_new: int) -> tuple[int, list]:
        """The inner gate's plan, ending at the request's state boundary if it would pass it."""
        num_new, work = self.inner.plan(request, start, num_new)
        end = self._boundary(request)
        if start < end < start + num_new:
            num_new = end - start
        return num_new, work

    def commit(self, request: Request, start: int, num_new: int, work: list) -> None:
        self.inner.commit(request, start, num_new, work)
        rid, size = request.request_id, request.block_size
        if rid not in self.admitted:
            self.admitted.add(rid)
            if start:  # its hit: the state kept after block start / size - 1
                self.restores[rid] = self.cache.take(request.block_hashes[start // size - 1])
        end = self._boundary(request)
        if end and start + num_new == end:
            slot = self.cache.reserve(request.block_hashes[end // size - 1])
            if slot is not None:
                self.saves[rid] = slot

    def take_inputs(self) -> dict:
        out = self.inner.take_inputs()
        out.update(state_restores=self.restores, state_saves=self.saves)
        self.restores, self.saves = {}, {}
        return out

    def rows(self, request: Request, num_new: int, into: dict) -> None:
        self.inner.rows(request, num_new, into)

    def release(self, request: Request) -> None:
        """Finished or preempted: a readmission restores (or recomputes) its state again."""
        self.inner.release(request)
        self.admitted.discard(request.request_id)
        self.boundary.pop(request.request_id, None)


def step_gate(
    encoder_cache: EncoderCacheManager | None, state_slots: int, kv: KVCacheManager
) -> EncoderGate | StateGate:
    """The scheduler's gate: a multimodal model's images (or none), wrapped for a hybrid
    model's kept states when it has state slots (their cache is reset with the prefix
    cache's)."""
    gate = NoEncoderGate() if encoder_cache is None else EncoderGate(encoder_cache)
    if not state_slots:
        return gate
    cache = StateCache(state_slots)
    kv.on_reset.append(cache.reset)
    return StateGate(gate, cache)
