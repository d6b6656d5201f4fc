"""The batched low-rank delta (pure torch), added in place into the base linear's output (a
fresh tensor of the linear's). Two forms, both the base GEMM once and then the deltas:

- runs (an extend of few requests per adapter): per distinct slot, `(x A^T) B` with the slot's
  own rank, on each contiguous run of its rows;
- masked (a decode batch, or requests of several adapters interleaved): one shrink over the
  batch's slots taken whole, a mask that keeps each row's own slot's rank columns, one expand —
  three ops whatever the number of adapters (no per-slot gathers), graph-safe on CUDA. On a CPU
  with the native kernels, one call instead (`lora_delta`, csrc/cpu_lora_delta.cpp: each row only
  its own slot's rank and, per stacked module, only that module's columns).
"""

from __future__ import annotations

import torch

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.native_small_ops import runs_native
from radixengine.lora.lora_batch_info import LoRABatchInfo, MaskedSlots


def apply_lora_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
    info: LoRABatchInfo,
    pieces: tuple[int, ...],
) -> torch.Tensor:
    """`y` (the base linear's output of `x`) plus each row's delta; `a_buf` `[slots, R, stack,
    in]`, `b_buf` `[slots, R, stack, out]` (B scaled, each stacked module's B in its own output
    columns: `pieces`, in order)."""
    if not info.segments:
        return y
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    if info.masked is not None:
        if runs_native(x2, y2, a_buf, b_buf):
            native_cpu_ops.require_native().lora_delta(
                y2, x2, a_buf, b_buf, info.masked.row_slot, info.masked.rank_of_slot, list(pieces)
            )
        else:
            _masked_delta(x2, y2, a_buf, b_buf, info.masked)
        return y
    for seg in info.segments:
        a = a_buf[seg.slot, : seg.rank].reshape(-1, a_buf.shape[-1])  # [r * stack, in]
        b = b_buf[seg.slot, : seg.rank].reshape(-1, b_buf.shape[-1])  # [r * stack, out]
        for start, end in seg.runs:
            y2[start:end].addmm_(x2[start:end] @ a.t(), b)
    return y


def _masked_delta(
    x2: torch.Tensor, y2: torch.Tensor, a_buf: torch.Tensor, b_buf: torch.Tensor, m: MaskedSlots
) -> None:
    _, max_rank, stack, _ = a_buf.shape
    a = a_buf[m.lo : m.hi].reshape(-1, a_buf.shape[-1])  # [span * R * stack, in]
    b = b_buf[m.lo : m.hi].reshape(-1, b_buf.shape[-1])  # [span * R * stack, out]
    shrunk = (x2 @ a.t()).mul_(m.mask(max_rank, stack, x2.dtype))
    y2.addmm_(shrunk, b)
