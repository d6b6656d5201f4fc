"""LoRABatchInfo: which slot each token row of a forward reads its delta from."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

# In the torch forms, a slot whose rows come in at most this many runs adds its delta run by run,
# in place (an extend's requests are runs); a batch with a slot of more runs (a decode batch: one
# row each) takes the masked form instead (lora_backend.py).
MAX_RUNS = 4
# Rows of one slot a GPU kernel program takes (`blocks`): the least M of a tensor-core dot.
KERNEL_BLOCK_ROWS = 16


@dataclass
class LoRASegment:
    slot: int
    rank: int
    runs: list[tuple[int, int]]  # row ranges [start, end) of this slot, in order


@dataclass
class LoRABatchInfo:
    segments: list[LoRASegment]  # one per distinct adapter slot of the batch (slot 0 has none)
    row_slot: torch.Tensor  # [rows] int64; 0 for a base-model row
    rank_of_slot: torch.Tensor  # [hi] int64
    lo: int  # the batch's slots are lo..hi-1 (others in between are masked out)
    hi: int
    # A captured CUDA graph's (lora/lora_graph.py): its kernels run whatever batch replays it.
    captured: bool = False
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    slot_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    row_blocks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def runs_delta(self) -> bool:
        """Whether the forward computes deltas: some row has an adapter, or a graph is captured."""
        return self.captured or bool(self.segments)

    @cached_property
    def scattered(self) -> bool:
        """A slot's rows come in more than MAX_RUNS runs (the torch forms mask, not loop)."""
        return any(len(seg.runs) > MAX_RUNS for seg in self.segments)

    def rows_of(self, seg: LoRASegment) -> torch.Tensor:
        """The slot's rows, int64, on the forward's device."""
        if seg.slot not in self.slot_rows:
            rows = torch.cat([torch.arange(start, end) for start, end in seg.runs])
            self.slot_rows[seg.slot] = _upload(rows, self.row_slot.device)
        return self.slot_rows[seg.slot]

    def blocks(self, block_rows: int) -> torch.Tensor:
        """int32 `[n, 3]` on the forward's device: (first row, rows, slot) of every run of a slot,
        cut into pieces of at most `block_rows` rows (the GPU kernels' programs)."""
        if block_rows not in self.row_blocks:
            table = [
                (first, min(block_rows, end - first), seg.slot)
                for seg in self.segments
                for start, end in seg.runs
                for first in range(start, end, block_rows)
            ]
            blocks = torch.tensor(table, dtype=torch.int32).reshape(-1, 3)
            self.row_blocks[block_rows] = _upload(blocks, self.row_slot.device)
        return self.row_blocks[block_rows]

    def mask(self, max_rank: int, stack: int, dtype: torch.dtype) -> torch.Tensor:
        """`[rows, (hi - lo) * max_rank * stack]`: 1 where the column is the row's slot's and
        within its rank (the pool's column order: slot, then rank, then stacked module)."""
        key = (max_rank, stack, dtype)
        if key not in self.masks:
            device = self.row_slot.device
            col_slot = torch.arange(self.lo, self.hi, device=device).repeat_interleave(max_rank * stack)
            col_r = torch.arange(max_rank, device=device).repeat_interleave(stack).repeat(self.hi - self.lo)
            in_rank = col_r < self.rank_of_slot[col_slot]
            self.masks[key] = ((self.row_slot[:, None] == col_slot[None, :]) & in_rank).to(dtype)
        return self.masks[key]

    @classmethod
    def build(
        cls, slots: list[int], tokens_per_req: list[int], ranks: dict[int, int], device: torch.device
    ) -> LoRABatchInfo:
        """`slots[i]`: request i's slot (0: the base model); `tokens_per_req[i]`: its rows in
        the forward, which come request after request."""
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(slots, tokens_per_req):
            if slot and n:
                slot_runs = runs.setdefault(slot, [])
                if slot_runs and slot_runs[-1][1] == start:
                    slot_runs[-1] = (slot_runs[-1][0], start + n)
                else:
                    slot_runs.append((start, start + n))
            start += n
        segments = [LoRASegment(slot, ranks[slot], r) for slot, r in sorted(runs.items())]
        lo, hi = (min(runs), max(runs) + 1) if runs else (1, 1)
        row_slot = torch.tensor(slots).repeat_interleave(torch.tensor(tokens_per_req))
        rank_of_slot = torch.tensor([ranks.get(s, 0) for s in range(hi)])
        return cls(segments, _upload(row_slot, device), _upload(rank_of_slot, device), lo, hi)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To the forward's device without waiting for it (pinned and non-blocking on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
