"""LoRAGraphBuffers: the LoRA batch of the captured CUDA decode graphs. A graph replays the kernel
launches it captured, with their grids and their pointers: the delta's Triton kernels
(layers/triton_ops/lora_delta.py) then read a block table and the slots' ranks from static
device tensors, refilled before each replay from the batch's own `LoRABatchInfo` by tensor ops
on the device (no host loop, no upload). A graph of `bs` rows launches `bs` programs a kernel,
block i being row i: one row of its slot, or none where the row has no adapter (a base-model or
padded row), whose program writes nothing. The adapters' weights are the pool's buffers, filled
in place (lora/mem_pool.py), so they need no copy."""

from __future__ import annotations

import torch

from radixengine.lora.lora_batch_info import KERNEL_BLOCK_ROWS, LoRABatchInfo


class LoRAGraphBuffers:
    def __init__(self, max_bs: int, num_slots: int, device: torch.device) -> None:
        self.blocks = torch.zeros(max_bs, 3, dtype=torch.int32, device=device)  # first row, rows, slot
        self.blocks[:, 0] = torch.arange(max_bs, dtype=torch.int32, device=device)
        self.rank_of_slot = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)

    def captured_info(self, bs: int) -> LoRABatchInfo:
        """The batch a graph of `bs` rows captures: the static tables, `bs` blocks."""
        info = LoRABatchInfo(
            segments=[],
            row_slot=self.blocks[:bs, 2],
            rank_of_slot=self.rank_of_slot,
            lo=0,
            hi=self.rank_of_slot.numel(),
            captured=True,
        )
        info.row_blocks[KERNEL_BLOCK_ROWS] = self.blocks[:bs]
        return info

    def fill(self, batch: LoRABatchInfo | None, graph_bs: int) -> None:
        """Before a replay of the graph of `graph_bs` rows: `batch`'s row slots and slot ranks
        (None: no adapter in the batch); its rows past the batch's have none."""
        slots = self.blocks[:graph_bs, 2]
        slots.zero_()
        if batch is not None:
            slots[: batch.row_slot.numel()].copy_(batch.row_slot, non_blocking=True)
            self.rank_of_slot[: batch.rank_of_slot.numel()].copy_(batch.rank_of_slot, non_blocking=True)
        self.blocks[:graph_bs, 1].copy_(slots > 0)
