"""bf16-stored linears in fp32 arithmetic, for CPUs without native bf16 products (no AMX, no
AVX512-BF16; e.g. AVX2 machines): there torch's bf16 matmul runs 4-5x slower than its fp32 one,
so each bf16 weight is packed once after loading into panels of 32 output columns
(``radixengine/csrc/cpu_bf16_linear.cpp``) that the native GEMM widens to fp32 vector by vector.
A decode step then streams half of fp32's bytes; prefill widens each panel once per block of
rows and runs fp32 register tiles.

Two uses, both chosen at load (``cpu_linear_plan``):

- a bf16 model (``--dtype bfloat16``) on such a CPU: every bf16 linear and the LM head;
- a float32 model whose weights all are bf16 values (a bf16 checkpoint run in float32, what
  ``--dtype auto`` picks on such a CPU): the same panels, exact, with float32 activations.

``bf16_linear_reference`` is the same product in pure torch, from the packed weight.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixengine.layers.amx_linear import fp32_sum_linear
from radixengine.layers.packed_weight import PackedWeight, pack_linears

logger = logging.getLogger(__name__)

COLS = 32  # output columns per packed panel


def bf16_pack_linear_weight_reference(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[N / 32, K, 32]``: ``packed[nb][k][c] = weight[32 nb + c][k]``."""
    n, k = weight.shape
    return weight.reshape(n // COLS, COLS, k).transpose(1, 2).contiguous()


def unpack_bf16_linear_weight(packed: torch.Tensor) -> torch.Tensor:
    nb, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(nb * COLS, k)


def bf16_linear_reference(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` from the packed weight: fp32 products and sums, rounded once to x's dtype."""
    return fp32_sum_linear(x, unpack_bf16_linear_weight(packed), bias)


def packable(weight: torch.Tensor) -> bool:
    """A CPU matrix whose output dimension is a multiple of 32."""
    return weight.dim() == 2 and weight.device.type == "cpu" and weight.shape[0] % COLS == 0


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether every value of a float weight is a bf16 value (so packing it in bf16 is exact)."""
    if weight.dtype == torch.bfloat16:
        return True
    return weight.dtype == torch.float32 and torch.equal(weight, weight.to(torch.bfloat16).float())


class Bf16PanelWeight(PackedWeight):
    """A linear's weight as bf16 panels of 32 output columns."""

    PACK_OP = "bf16_pack_linear_weight"
    LINEAR_OP = "bf16_linear"

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        return super().pack(weight.to(torch.bfloat16).contiguous())


def pack_bf16_linears(model: nn.Module) -> int:
    """Pack the weight of every module that takes a packed weight (linears, the LM head), holds
    bf16 values and has no GGUF blocks into bf16 panels; its float weight is dropped unless it also
    serves as an embedding. Returns how many were packed."""
    count = pack_linears(model, Bf16PanelWeight, _fits_panels)
    logger.info("weights of %d linears packed as bf16 panels (fp32 arithmetic)", count)
    return count


def _fits_panels(module: nn.Module, weight: torch.Tensor) -> bool:
    """No GGUF blocks (they keep their own kernels), a packable shape, bf16 values."""
    no_blocks = getattr(module, "block_weight", None) is None
    return no_blocks and packable(weight) and holds_bf16_values(weight.data)
