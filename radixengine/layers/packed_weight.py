"""PackedWeight: a linear's weight packed once, at load, for one of the native CPU GEMMs (AMX
tiles, bf16 panels); each kind names its native pack and GEMM ops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from radixengine.layers.attention import native_cpu_ops


@dataclass
class PackedWeight:
    PACK_OP: ClassVar[str]  # native op: weight [N, K] -> packed
    LINEAR_OP: ClassVar[str]  # native op: (x [M, K], packed, bias) -> [M, N]

    packed: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        native = native_cpu_ops.require_native()
        return cls(getattr(native, cls.PACK_OP)(weight), weight.shape[0], weight.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        gemm = getattr(native_cpu_ops.require_native(), self.LINEAR_OP)
        return gemm(rows.contiguous(), self.packed, bias).view(*x.shape[:-1], self.out_features)


def pack_linears(
    model: nn.Module, kind: type[PackedWeight], fits: Callable[[nn.Module, torch.Tensor], bool]
) -> int:
    """Pack, as `kind`, the weight of every module that takes a packed weight (linears, the LM
    head: `model.lm_head`, an embedding table when tied) when `fits(module, weight)`; a module's
    float weight is dropped unless it also serves as an embedding. Returns how many were packed."""
    lm_head = getattr(model, "lm_head", None)
    count = 0
    for module in model.modules():
        if not hasattr(module, "amx_weight") or not (module.accepts_amx_weight() or module is lm_head):
            continue
        weight = module.weight
        if weight is None or not fits(module, weight):
            continue
        module.amx_weight = kind.pack(weight.data)
        if not module.keeps_float_weight():
            module.weight = None
        count += 1
    return count
