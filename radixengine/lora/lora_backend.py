"""The batched low-rank delta, added in place into the base linear's output (a fresh tensor of
the linear's): the base GEMM once, then the deltas. On a CPU with the native kernels, one call
for the batch, whatever its size (`lora_delta`, csrc/cpu_lora_delta.cpp: each row only its own
slot's rank and, per stacked module, only that module's columns, rows of one slot sharing each
weight load). Torch's GEMMs lose to it in fp32 at every size, and in bf16 they would be faster
on long prefill runs only if their shapes repeated: oneDNN builds a kernel for every new row
count (~1.2 ms here), and a serving batch's run lengths rarely repeat (docs/lora.md "The
delta"). On CUDA, two Triton launches (layers/triton_ops/lora_delta.py: a shrink and an expand,
each program up to 16 rows of one slot), unless RADIXENGINE_TRITON_LORA=0 (read at import) asks
for the torch forms, which a CPU without the native kernels takes too:

- runs (an extend of few requests per adapter): per distinct slot, `(x A^T) B` with the slot's
  own rank, on each contiguous run of its rows;
- masked (a decode-sized batch of interleaved adapters): one shrink over the batch's slots taken
  whole, a mask that keeps each row's own slot's rank columns, one expand — three ops whatever
  the number of adapters;
- gathered (a large batch of interleaved adapters): per slot, its rows gathered, shrunk,
  expanded and added back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.native_small_ops import runs_native
from radixengine.lora.lora_batch_info import KERNEL_BLOCK_ROWS, LoRABatchInfo, LoRASegment

# The masked form computes every batch slot's columns for every row: for decode-sized batches.
MASKED_MAX_ROWS = 256
TRITON_ON_CUDA = os.environ.get("RADIXENGINE_TRITON_LORA", "1") != "0"


def apply_lora_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
    info: LoRABatchInfo,
    pieces: Sequence[int],
) -> torch.Tensor:
    """`y` (the base linear's output of `x`) plus each row's delta; `a_buf` `[slots, R, stack,
    in]`, `b_buf` `[slots, R, stack, out]` (B scaled, each stacked module's B in its own output
    columns: `pieces`, in order)."""
    if not info.runs_delta:
        return y
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    if runs_native(x2, y2, a_buf, b_buf):
        lib = native_cpu_ops.require_native()
        lib.lora_delta(y2, x2, a_buf, b_buf, info.row_slot, info.rank_of_slot, pieces)
    elif x2.is_cuda and TRITON_ON_CUDA:
        triton_delta(x2, y2, a_buf, b_buf, info, pieces)
    elif not info.scattered:
        _runs_delta(x2, y2, a_buf, b_buf, info)
    elif x2.shape[0] <= MASKED_MAX_ROWS:
        _masked_delta(x2, y2, a_buf, b_buf, info)
    else:
        gathered_delta(x2, y2, a_buf, b_buf, info)
    return y


def triton_delta(
    x2: torch.Tensor,
    y2: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
    info: LoRABatchInfo,
    pieces: Sequence[int],
) -> None:
    """The GPU kernels (imported here: a CPU process never loads Triton)."""
    from radixengine.layers.triton_ops import lora_delta as kernels

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    offsets = _column_offsets(tuple(pieces), x2.device)
    kernels.lora_delta(
        y2,
        x2,
        a_buf,
        b_buf,
        info.blocks(KERNEL_BLOCK_ROWS),
        info.rank_of_slot,
        offsets,
        max(pieces),
        KERNEL_BLOCK_ROWS,
    )


_OFFSETS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _column_offsets(pieces: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The stacked modules' first output columns and the end, int32 on `device` (made once)."""
    key = (pieces, device)
    if key not in _OFFSETS:
        offsets = torch.tensor([0, *pieces], dtype=torch.int32).cumsum(0).to(torch.int32)
        _OFFSETS[key] = (
            offsets.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else offsets
        )
    return _OFFSETS[key]


def _runs_delta(
    x2: torch.Tensor, y2: torch.Tensor, a_buf: torch.Tensor, b_buf: torch.Tensor, info: LoRABatchInfo
) -> None:
    for seg in info.segments:
        a, b = _slot_weights(a_buf, b_buf, seg)
        for start, end in seg.runs:
            y2[start:end].addmm_(x2[start:end] @ a.t(), b)


def gathered_delta(
    x2: torch.Tensor, y2: torch.Tensor, a_buf: torch.Tensor, b_buf: torch.Tensor, info: LoRABatchInfo
) -> None:
    for seg in info.segments:
        a, b = _slot_weights(a_buf, b_buf, seg)
        rows = info.rows_of(seg)
        y2.index_add_(0, rows, (x2.index_select(0, rows) @ a.t()) @ b)


def _slot_weights(
    a_buf: torch.Tensor, b_buf: torch.Tensor, seg: LoRASegment
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's A `[r * stack, in]` and B `[r * stack, out]`, its own rank only."""
    a = a_buf[seg.slot, : seg.rank].reshape(-1, a_buf.shape[-1])
    b = b_buf[seg.slot, : seg.rank].reshape(-1, b_buf.shape[-1])
    return a, b


def _masked_delta(
    x2: torch.Tensor, y2: torch.Tensor, a_buf: torch.Tensor, b_buf: torch.Tensor, m: LoRABatchInfo
) -> None:
    _, max_rank, stack, _ = a_buf.shape
    a = a_buf[m.lo : m.hi].reshape(-1, a_buf.shape[-1])  # [span * R * stack, in]
    b = b_buf[m.lo : m.hi].reshape(-1, b_buf.shape[-1])  # [span * R * stack, out]
    shrunk = (x2 @ a.t()).mul_(m.mask(max_rank, stack, x2.dtype))
    y2.addmm_(shrunk, b)
