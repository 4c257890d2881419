"""The rows of one forward pass and their paged-KV metadata. The runner builds
them; both plans read them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rows:
    """The rows of one forward pass, as plain lists (built by the runner)."""
    input_ids: list
    positions: list
    slots: list
    seqs: list          # (row_start, row_end, block_table) per sequence, rows contiguous
    sample_rows: list   # rows whose logits are wanted, in order
    greedy: list = field(default_factory=list)   # per sample row; empty = none known greedy
    extra_rows: list = field(default_factory=list)   # rows wanted for logprobs only (prompt logprobs)

    def __len__(self):
        return len(self.input_ids)

    def add_chunk(self, ids, first: int, block_table: list, block_size: int) -> int:
        """Append one sequence's contiguous chunk: tokens `ids` at positions first,
        first + 1, ..., each writing its KV to its slot of `block_table`. Returns the
        chunk's first row; the caller adds its sample rows."""
        start = len(self)
        for i, token in enumerate(ids):
            p = first + i
            self.input_ids.append(token)
            self.positions.append(p)
            self.slots.append(block_table[p // block_size] * block_size + p % block_size)
        self.seqs.append((start, len(self), block_table))
        return start


def slot_tensor(block_table: list, length: int, block_size: int, device) -> torch.Tensor:
    blocks = torch.tensor(block_table, dtype=torch.int64, device=device)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=device)).view(-1)
    return slots[:length]


def seq_block_tables(seqs: list, num_rows: int, width: int) -> torch.Tensor:
    """[num_rows, width] block ids, one row per query row: each of a sequence's rows
    (Rows.seqs: row_start, row_end, block_table) gets its table, one copy per
    sequence; zeros past a table's end (those keys are masked by position) and for
    rows of no sequence (padding)."""
    out = torch.zeros(num_rows, width, dtype=torch.int64)
    for start, end, table in seqs:
        if table:
            t = table[:width]
            out[start:end, :len(t)] = torch.tensor(t, dtype=torch.int64)
    return out
