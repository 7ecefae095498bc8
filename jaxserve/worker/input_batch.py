"""Persistent host-side state of the requests the model runner holds (vLLM V1's InputBatch).

Each request owns a row from the moment it is scheduled until it finishes or is preempted:
its token ids (prompt + generated), block tables (one per KV-cache group) and sampling
parameters (as arrays, worker/sampling_rows.py) live in preallocated numpy arrays, so building
a step's inputs is slicing and a few vectorised writes, never a rebuild from the scheduler's
objects.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler_output import NewRequestData, SchedulerOutput
from jaxserve.worker.sampling_rows import SamplingRows


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, num_groups: int = 1
    ):
        """num_groups: the KV-cache groups (config/kv_groups.py), each a block table per row."""
        self.max_num_reqs = max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)  # prompt + generated, known so far
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        self.block_table = np.zeros((num_groups, max_num_reqs, max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)  # every group's table is this long
        # Tokens whose KV is computed, as the scheduler said in the latest step (where that
        # step's tokens start).
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)
        # LoRA: each row's adapter (lora_int_id, 0: none) and its device slot this step (-1:
        # none), set by worker/lora_slots.py
        self.lora_ids = np.zeros(max_num_reqs, np.int64)
        self.lora_slots = np.full(max_num_reqs, -1, np.int32)
        self.sampling = SamplingRows(max_num_reqs)

    def update(self, so: SchedulerOutput) -> list[int]:
        """Apply a step's scheduler output: drop finished and preempted requests, add the new
        (or resumed) ones, append the running ones' new blocks. Returns the rows of the added
        requests whose penalty state must be filled from their tokens (penalised ones)."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.remove_request(req_id)
        penalised = []
        for new in so.scheduled_new_reqs:
            row = self.add_request(new)
            self.num_computed_tokens[row] = new.num_computed_tokens
            if self.sampling.penalised[row]:
                penalised.append(row)
        cached = so.scheduled_cached_reqs
        rows = [self.req_id_to_row[c.req_id] for c in cached]
        for row, c in zip(rows, cached, strict=True):
            if c.new_block_ids:  # (most decode steps have none: ())
                self.append_blocks(row, c.new_block_ids)
        self.num_computed_tokens[rows] = [c.num_computed_tokens for c in cached]
        return penalised

    def add_request(self, new: NewRequestData) -> int:
        if not self.free_rows:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)")
        row = self.free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.lora_ids[row], self.lora_slots[row] = new.lora_int_id, -1
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self.sampling.add(row, new.sampling_params, new.eos_token_id)
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)
            self.lora_ids[row] = 0

    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Each group's new blocks (as many in every group)."""
        n = self.num_blocks[row]
        for table, ids in zip(self.block_table, block_ids, strict=True):
            table[row, n : n + len(ids)] = ids
        self.num_blocks[row] = n + len(block_ids[0]) if block_ids else n

    def holds(self, req_id: str, row: int) -> bool:
        """Whether `row` still belongs to `req_id` (a row freed by a finished request may have
        gone to another one while a step of the first was in flight)."""
        return self.req_id_to_row.get(req_id) == row

    def append_sampled(self, batch, row_ids: np.ndarray, kept_row: np.ndarray) -> None:
        """A fetched step's new tokens (row_ids: i32[S], every sampling row's sample;
        kept_row: i32[num_reqs], each request's row whose sample it kept): each request that
        sampled takes its rows' samples up to its kept one (its accepted drafts, then the
        kept token), unless its row has since gone to another request."""
        for i in np.flatnonzero(batch.sampled):
            row = batch.rows[i]
            if self.holds(batch.req_ids[i], row):
                tokens = row_ids[batch.first_row[i] : kept_row[i] + 1]
                n = self.num_tokens[row]
                self.token_ids[row, n : n + len(tokens)] = tokens
                self.num_tokens[row] = n + len(tokens)
