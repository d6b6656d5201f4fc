"""The batched low-rank delta (SGMV-style, pure torch): per distinct slot of the batch, `(x A^T) B`
with the slot's own rank over its rows, added in place into the base linear's output (a fresh
tensor of the linear's). An extend's rows of one slot are a few runs, each computed on its
slice; a decode batch's are gathered and scattered back."""

from __future__ import annotations

import torch

from radixengine.lora.lora_batch_info import LoRABatchInfo


def apply_lora_delta(
    x: torch.Tensor, y: torch.Tensor, a_buf: torch.Tensor, b_buf: torch.Tensor, info: LoRABatchInfo
) -> torch.Tensor:
    """`y` (the base linear's output of `x`) plus each row's delta; `a_buf` `[slots, R, stack,
    in]`, `b_buf` `[slots, R, stack, out]` (B scaled)."""
    if not info.segments:
        return y
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    for seg in info.segments:
        a = a_buf[seg.slot, : seg.rank].reshape(-1, a_buf.shape[-1])  # [r * stack, in]
        b = b_buf[seg.slot, : seg.rank].reshape(-1, b_buf.shape[-1])  # [r * stack, out]
        if seg.rows is not None:
            y2.index_add_(0, seg.rows, (x2.index_select(0, seg.rows) @ a.t()) @ b)
            continue
        for start, end in seg.runs:
            y2[start:end].addmm_(x2[start:end] @ a.t(), b)
    return y
