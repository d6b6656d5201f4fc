"""LoRABatchInfo: which slot each token of a forward reads its delta from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRASegment:
    slot: int
    rank: int
    rows: torch.Tensor | None  # int64 token rows of this slot; None: every row of the batch


@dataclass
class LoRABatchInfo:
    segments: list[LoRASegment]  # one per distinct adapter slot of the batch (slot 0 has none)

    @classmethod
    def build(
        cls, slots: list[int], tokens_per_req: list[int], ranks: dict[int, int], device: torch.device
    ) -> LoRABatchInfo:
        """`slots[i]`: request i's slot (0: the base model); `tokens_per_req[i]`: its rows in
        the forward, which come request after request."""
        per_token = torch.repeat_interleave(
            torch.tensor(slots, dtype=torch.int64), torch.tensor(tokens_per_req, dtype=torch.int64)
        )
        segments = []
        for slot in sorted(set(slots) - {0}):
            if all(s == slot for s in slots):
                rows = None
            else:
                rows = torch.nonzero(per_token == slot).flatten().to(device)
            segments.append(LoRASegment(slot, ranks[slot], rows))
        return cls(segments)
