"""Linear layers whose weights load shard by shard: fused q/k/v and fused gate/up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x W^T + b`; parameters are allocated uninitialised (the loader fills them)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param.data, loaded)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (gate_up_proj); shards 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_range(self, shard_id) -> tuple[int, int]:
        start = sum(self.output_sizes[:shard_id])
        return start, self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        start, size = self.shard_range(shard_id)
        _copy(param.data.narrow(0, start, size), loaded)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; shards "q", "k", "v"."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, bias)
        self.q_size, self.kv_size = sizes[0], sizes[1]

    def shard_range(self, shard_id) -> tuple[int, int]:
        return super().shard_range({"q": 0, "k": 1, "v": 2}[shard_id])


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not match parameter {tuple(dst.shape)}")
    dst.copy_(src)
