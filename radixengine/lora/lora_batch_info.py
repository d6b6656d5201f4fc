"""LoRABatchInfo: which slot each token row of a forward reads its delta from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A slot whose rows come in at most this many runs adds its delta run by run, in place (an
# extend's requests are runs); more runs (a decode batch: one row each) gather and scatter.
MAX_RUNS = 4


@dataclass
class LoRASegment:
    slot: int
    rank: int
    runs: list[tuple[int, int]]  # row ranges [start, end) of this slot, in order
    rows: torch.Tensor | None = None  # int64 rows, when there are more than MAX_RUNS runs


@dataclass
class LoRABatchInfo:
    segments: list[LoRASegment]  # one per distinct adapter slot of the batch (slot 0 has none)

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
        segments = []
        for slot, slot_runs in sorted(runs.items()):
            rows = None
            if len(slot_runs) > MAX_RUNS:
                rows = torch.cat([torch.arange(s, e) for s, e in slot_runs]).to(device)
            segments.append(LoRASegment(slot, ranks[slot], slot_runs, rows))
        return cls(segments)
