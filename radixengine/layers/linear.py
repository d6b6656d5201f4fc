"""Linear layers whose weights load shard by shard: fused q/k/v and fused gate/up.

A linear may also hold its weight as GGUF blocks (`BlockWeight`, loaded beside the float
weight when the model comes from a GGUF): on a CPU, batches of at most `max_tokens` rows (decode)
then read the blocks (6x fewer bytes than float32 for Q4_1, 7x for Q4_K) and larger ones
(prefill) use the float weight. Both compute with the same dequantized values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class BlockPart:
    """Output rows `[start, start + rows.shape[0])` of a weight as GGUF blocks of one type: uint8
    rows `[rows, in_features / block_weights * block_bytes]`."""

    start: int
    rows: torch.Tensor
    qtype: int


@dataclass
class BlockWeight:
    """A weight as GGUF blocks, in parts of one block type each (a fused projection whose shards
    come in different types, as q/k in Q4_K and v in Q6_K, has one part per run of a type)."""

    parts: list[BlockPart]
    max_tokens: int  # the block kernel runs for inputs of at most this many rows

    @classmethod
    def of(cls, rows: torch.Tensor, qtype: int, max_tokens: int) -> BlockWeight:
        return cls([BlockPart(0, rows, qtype)], max_tokens)

    @property
    def num_rows(self) -> int:
        return sum(p.rows.shape[0] for p in self.parts)

    def add(self, start: int, rows: torch.Tensor, qtype: int) -> None:
        """Adds rows `[start, start + len(rows))`; a part next to one of the same type joins it."""
        parts = sorted([*self.parts, BlockPart(start, rows.contiguous(), qtype)], key=lambda p: p.start)
        merged = [parts[0]]
        for part in parts[1:]:
            last = merged[-1]
            if last.qtype == part.qtype and last.start + last.rows.shape[0] == part.start:
                merged[-1] = BlockPart(last.start, torch.cat([last.rows, part.rows]), last.qtype)
            else:
                merged.append(part)
        self.parts = merged

    def covers(self, out_features: int) -> bool:
        """Whether the parts are exactly rows `[0, out_features)`, each once."""
        end = 0
        for part in self.parts:
            if part.start != end:
                return False
            end += part.rows.shape[0]
        return end == out_features

    def applies_to(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() <= self.max_tokens * x.shape[-1]
        )

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        from radixengine.layers.gguf_quant_ops import quant_linear

        if len(self.parts) == 1:
            return quant_linear(x, self.parts[0].rows, self.parts[0].qtype)
        return torch.cat([quant_linear(x, p.rows, p.qtype) for p in self.parts], dim=-1)


def block_linear(x: torch.Tensor, weight: torch.Tensor, block: BlockWeight | None) -> torch.Tensor:
    """`x @ weight.T`, through the GGUF blocks when they apply to `x`."""
    if block is not None and block.applies_to(x):
        return block.linear(x)
    return F.linear(x, weight)


class Linear(nn.Module):
    """`y = x W^T + b`; parameters are allocated uninitialised (the loader fills them)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.block_weight: BlockWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_weight is None or not self.block_weight.applies_to(x):
            return F.linear(x, self.weight, self.bias)
        y = self.block_weight.linear(x)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param.data, loaded)

    def shard_range(self, shard_id) -> tuple[int, int]:
        return 0, self.output_size

    def block_weight_loader(self, rows: torch.Tensor, qtype: int, max_tokens: int, shard_id=None) -> None:
        """Place one shard's GGUF block rows (each shard in its own block type)."""
        start, size = self.shard_range(shard_id)
        if rows.shape[0] != size:
            raise ValueError(f"shard {shard_id!r} has {rows.shape[0]} GGUF rows, expected {size}")
        if self.block_weight is None:
            self.block_weight = BlockWeight([], max_tokens)
        self.block_weight.add(start, rows, qtype)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (gate_up_proj); shards 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_range(self, shard_id) -> tuple[int, int]:
        if shard_id is None:
            return 0, self.output_size
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
        return super().shard_range(None if shard_id is None else {"q": 0, "k": 1, "v": 2}[shard_id])


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not match parameter {tuple(dst.shape)}")
    dst.copy_(src)
