"""LoRAGraphBuffers: the LoRA batch of the captured CUDA decode graphs. A graph replays the kernel
launches it captured, with their grids and their pointers: the delta's Triton kernels
(layers/triton_ops/lora_delta.py) then read a block table and the slots' ranks from static
device tensors, refilled before each replay from the batch's own `LoRABatchInfo`. A graph of
batch size `bs` launches `bs` programs a kernel (a decode batch has at most one block a row);
the entries past the batch's blocks have no rows, so their programs write nothing. The adapters'
weights are the pool's buffers, filled in place (lora/mem_pool.py), so they need no copy."""

from __future__ import annotations

import torch

from radixengine.lora.lora_batch_info import LoRABatchInfo, LoRASegment


class LoRAGraphBuffers:
    def __init__(self, max_bs: int, num_slots: int, block_rows: int, device: torch.device) -> None:
        """`block_rows`: the rows a kernel program takes (the block table's unit)."""
        self.block_rows = block_rows
        self.blocks = torch.zeros(max_bs, 3, dtype=torch.int32, device=device)  # first row, rows, slot
        self.rank_of_slot = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self.row_slot = torch.zeros(max_bs, dtype=torch.int64, device=device)

    def captured_info(self, bs: int) -> LoRABatchInfo:
        """The batch a graph of `bs` rows captures: the static tables, `bs` block entries."""
        info = LoRABatchInfo(
            segments=[LoRASegment(0, 0, [])],
            row_slot=self.row_slot[:bs],
            rank_of_slot=self.rank_of_slot,
            lo=0,
            hi=self.rank_of_slot.numel(),
            captured=True,
        )
        info.row_blocks[self.block_rows] = self.blocks[:bs]
        return info

    def fill(self, batch: LoRABatchInfo | None, graph_bs: int) -> None:
        """Before a replay of the graph of `graph_bs` rows: `batch`'s blocks and ranks (None or no
        adapter: no block)."""
        n = 0
        if batch is not None and batch.segments:
            blocks = batch.blocks(self.block_rows)
            n = blocks.shape[0]
            if n > graph_bs:
                raise ValueError(f"a decode batch of {n} LoRA blocks for a graph of {graph_bs} rows")
            self.blocks[:n].copy_(blocks, non_blocking=True)
            self.rank_of_slot[: batch.rank_of_slot.numel()].copy_(batch.rank_of_slot, non_blocking=True)
        self.blocks[n:graph_bs].zero_()
