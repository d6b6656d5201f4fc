"""LoRAMemoryPool: the adapters a batch can use, in a fixed number of slots.

Per layer and fused module, A `[slots + 1, R, stack, in]` and B `[slots + 1, R, stack, out]`
(`in` and `out`: this TP rank's; R = --max-lora-rank; the rank axis outermost, so slot s of rank
r is the contiguous views `A[s, :r]` and `B[s, :r]`). Slot 0 is the base model (zeros, never
computed)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixengine.lora.lora_adapter import BaseShapes, LoRAAdapter
from radixengine.lora.lora_config import FUSED_MODULES

EVICTION_POLICIES = ("lru", "fifo")


@dataclass
class _Slot:
    lora_id: str | None = None
    rank: int = 0
    pinned: bool = False
    loaded_at: int = 0
    used_at: int = 0


class LoRAMemoryPool:
    def __init__(
        self,
        shapes: BaseShapes,
        max_loras_per_batch: int,
        max_lora_rank: int,
        eviction_policy: str,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"--lora-eviction-policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}"
            )
        self.max_lora_rank = max_lora_rank
        self.eviction_policy = eviction_policy
        self.buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for key, shape in shapes.items():
            stack = FUSED_MODULES[key[1]]
            n = max_loras_per_batch + 1
            self.buffers[key] = (
                torch.zeros(n, max_lora_rank, stack, shape.rank_in_features, dtype=dtype, device=device),
                torch.zeros(n, max_lora_rank, stack, sum(shape.rank_out_sizes), dtype=dtype, device=device),
            )
        self.slots = [_Slot() for _ in range(max_loras_per_batch + 1)]
        self.slot_of: dict[str, int] = {}
        self._clock = itertools.count(1)

    @property
    def num_slots(self) -> int:
        return len(self.slots) - 1

    def rank_of(self, slot: int) -> int:
        return self.slots[slot].rank

    def num_pinned(self) -> int:
        return sum(s.pinned for s in self.slots)

    def prepare(self, needed: dict[str, LoRAAdapter], pinned: set[str]) -> dict[str, int]:
        """A slot for each adapter of a batch (copying in those not there yet); returns
        lora_id → slot."""
        if len(needed) > self.num_slots:
            raise RuntimeError(
                f"a batch uses {len(needed)} adapters, more than the pool's {self.num_slots} slots"
            )
        now = next(self._clock)
        for lora_id, adapter in needed.items():
            slot = self.slot_of.get(lora_id)
            if slot is None:
                slot = self._victim(set(needed))
                self._load(slot, lora_id, adapter, lora_id in pinned, now)
            self.slots[slot].used_at = now
        return {lora_id: self.slot_of[lora_id] for lora_id in needed}

    def drop(self, lora_id: str) -> None:
        """Forget an unloaded adapter's slot (its weights stay until the slot is reused)."""
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.slots[slot] = _Slot()

    def _victim(self, in_batch: set[str]) -> int:
        free = [i for i in range(1, len(self.slots)) if self.slots[i].lora_id is None]
        if free:
            return free[0]
        candidates = [
            i
            for i in range(1, len(self.slots))
            if not self.slots[i].pinned and self.slots[i].lora_id not in in_batch
        ]
        if not candidates:
            raise RuntimeError("every LoRA slot is pinned or used by this batch")
        order = (
            (lambda i: self.slots[i].used_at)
            if self.eviction_policy == "lru"
            else (lambda i: self.slots[i].loaded_at)
        )
        return min(candidates, key=order)

    def _load(self, slot: int, lora_id: str, adapter: LoRAAdapter, pinned: bool, now: int) -> None:
        old = self.slots[slot].lora_id
        if old is not None:
            del self.slot_of[old]
        r = adapter.rank
        for key, (a_buf, b_buf) in self.buffers.items():
            weights = adapter.weights.get(key)
            a_buf[slot].zero_()
            b_buf[slot].zero_()
            if weights is not None:
                a_buf[slot, :r].copy_(weights[0])
                b_buf[slot, :r].copy_(weights[1])
        self.slots[slot] = _Slot(lora_id, r, pinned, loaded_at=now, used_at=now)
        self.slot_of[lora_id] = slot
