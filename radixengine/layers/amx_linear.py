"""bf16 linears on AMX tiles (Intel CPUs with AMX-BF16): each weight packed once after loading
into the layout the tile products read (``radixengine/csrc/cpu_amx_linear.cpp``), so that a
decode step streams every weight from memory once, front to back, with fp32 sums.

``pack_amx_linears(model)`` replaces the float weight of every linear it packs (the memory is not
doubled); a tied LM head keeps the embedding's weight and packs a copy. The layers then compute
with ``AmxWeight.linear`` for every batch size: about 2x oneDNN's bf16 matmul for a decode step's
rows, a little slower than it on 2048-row prefill chunks (docs/benchmarks.md, "The rest of the
step on AMX"), which is the price of holding each weight once. ``amx_linear_reference`` is the
same product in pure torch, from the packed weight.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.packed_weight import PackedWeight, pack_linears

logger = logging.getLogger(__name__)

COLS, DEPTH = 32, 32  # output columns per packed block, input features per tile product


def amx_linear_unavailable_reason() -> str | None:
    """Why bf16 linears cannot run on AMX tiles in this process; None when they can.
    ``RADIXENGINE_AMX_LINEAR=0`` turns them off (the ablation)."""
    if os.environ.get("RADIXENGINE_AMX_LINEAR", "1") == "0":
        return "RADIXENGINE_AMX_LINEAR=0"
    native = native_cpu_ops.native_module_with("amx_linear")
    if native is None:
        return "the native CPU kernels with amx_linear are not built"
    if not native_cpu_ops.native_amx_available():
        return "this CPU (or build) has no AMX-BF16 tiles"
    return None


def packable(weight: torch.Tensor) -> bool:
    """A bf16 CPU matrix whose both dimensions are multiples of 32."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[0] % COLS == 0
        and weight.shape[1] % DEPTH == 0
    )


def amx_pack_linear_weight_reference(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[N / 32, K / 32, 2, 16, 16, 2]``: ``packed[nb][kb][t][p][c][e] =
    weight[32 nb + 16 t + c][32 kb + 2 p + e]`` (per block of 32 outputs and 32 inputs, two tile
    operands of 16 rows, each row 16 outputs x a pair of inputs)."""
    n, k = weight.shape
    return weight.reshape(n // COLS, 2, 16, k // DEPTH, DEPTH // 2, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def unpack_linear_weight(packed: torch.Tensor) -> torch.Tensor:
    nb, kb = packed.shape[:2]
    return packed.permute(0, 2, 4, 1, 3, 5).reshape(nb * COLS, kb * DEPTH)


def amx_linear_reference(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` from the packed weight: fp32 products and sums, rounded once to bf16."""
    return fp32_sum_linear(x, unpack_linear_weight(packed), bias)


def fp32_sum_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with fp32 products and sums, rounded once to x's dtype: what the
    packed CPU linears compute (their pure-torch references)."""
    y = F.linear(x.float(), weight.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class AmxWeight(PackedWeight):
    """A linear's weight in the AMX tile layout."""

    PACK_OP = "amx_pack_linear_weight"
    LINEAR_OP = "amx_linear"


def pack_amx_linears(model: nn.Module) -> int:
    """Pack the bf16 weight of every module that takes an ``amx_weight`` (linears, the LM head:
    ``model.lm_head``, an embedding table when tied) and whose weight fits the kernel; a module's
    float weight is dropped unless it also serves as an embedding. Returns how many were packed."""
    count = pack_linears(model, AmxWeight, lambda module, weight: packable(weight))
    logger.info("bf16 weights of %d linears packed for AMX tiles", count)
    return count
