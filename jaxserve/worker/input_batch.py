"""Persistent host-side state of the requests the model runner holds (vLLM V1's InputBatch).

Each request owns a row from the moment it is scheduled until it finishes or is preempted:
its token ids (prompt + generated), block table and sampling parameters live in preallocated
numpy arrays, so building a step's inputs is slicing and a few vectorised writes, never a
rebuild from the scheduler's objects.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler_output import NewRequestData
from jaxserve.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int):
        self.max_num_reqs = max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.eos_token_ids: list[int | None] = [None] * max_num_reqs

        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)  # prompt + generated, known so far
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)

    def add_request(self, new: NewRequestData, eos_token_id: int | None) -> int:
        if not self.free_rows:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)")
        row = self.free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self.params[row] = new.sampling_params
        self.eos_token_ids[row] = eos_token_id
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.params[row] = None
            self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        n = self.num_blocks[row]
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def num_output_tokens(self, row: int) -> int:
        return int(self.num_tokens[row] - self.num_prompt_tokens[row])
