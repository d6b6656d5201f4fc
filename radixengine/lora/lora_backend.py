"""The batched low-rank delta (SGMV-style, pure torch): per distinct slot of the batch, its
tokens' rows gathered, `(x A^T) B` with the slot's rank, added back into the base output."""

from __future__ import annotations

import torch

from radixengine.lora.lora_batch_info import LoRABatchInfo


def apply_lora_delta(
    x: torch.Tensor, y: torch.Tensor, a_buf: torch.Tensor, b_buf: torch.Tensor, info: LoRABatchInfo
) -> torch.Tensor:
    """`y` (the base linear's output of `x`) plus each token's delta; `a_buf` `[slots, R, stack,
    in]`, `b_buf` `[slots, R, stack, out]` (B scaled)."""
    if not info.segments:
        return y
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.reshape(-1, y.shape[-1])
    for seg in info.segments:
        a = a_buf[seg.slot, : seg.rank].reshape(-1, a_buf.shape[-1])  # [r * stack, in]
        b = b_buf[seg.slot, : seg.rank].reshape(-1, b_buf.shape[-1])  # [r * stack, out]
        if seg.rows is None:
            y2 = torch.addmm(y2, x2 @ a.t(), b)
        else:
            y2 = y2.index_add(0, seg.rows, (x2.index_select(0, seg.rows) @ a.t()) @ b)
    return y2.view(y.shape)
