"""Linear layers whose weights load shard by shard: fused q/k/v and fused gate/up; under tensor
parallelism (SGLang's layers) each rank holds its slice, cut from the whole checkpoint tensor at
load: column-parallel layers (q/k/v, gate/up) a run of output rows, row-parallel ones (o, down)
a run of input columns, their partial outputs summed over the ranks.

A linear may also hold its weight as GGUF blocks (`BlockWeight`, loaded beside the float
weight when the model comes from a GGUF): on a CPU, batches of at most `max_tokens` rows (decode)
then read the blocks (6x fewer bytes than float32 for Q4_1, 7x for Q4_K) and larger ones
(prefill) use the float weight. Both compute with the same dequantized values.

A LoRA adapter's delta rides on a linear as its `output_delta`: added to this rank's output (a
row-parallel linear's partial output, before the ranks' sum, so the sum carries it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixengine.distributed import get_tp_group, tensor_model_parallel_all_reduce
from radixengine.layers.packed_weight import PackedWeight


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


class OutputDelta(Protocol):
    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (this rank's output of `x`) with the delta added."""
        ...


class Linear(nn.Module):
    """`y = x W^T + b`, the whole weight on every rank; parameters are allocated uninitialised
    (the loader fills them). `output_size` is this rank's."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.block_weight: BlockWeight | None = None
        # A packed weight (AMX tiles or bf16 panels, layers/cpu_linear_plan.py), which drops `weight`
        self.amx_weight: PackedWeight | None = None
        self.output_delta: OutputDelta | None = None

    def accepts_amx_weight(self) -> bool:
        return True

    def keeps_float_weight(self) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base_linear(x)
        return y if self.output_delta is None else self.output_delta(x, y)

    def _base_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx_weight is not None:
            return self.amx_weight.linear(x, self.bias)
        if self.block_weight is None or not self.block_weight.applies_to(x):
            return F.linear(x, self.weight, self.bias)
        y = self.block_weight.linear(x)
        return y if self.bias is None else y + self.bias

    def shard_offsets(self, shard_id) -> tuple[int, int, int]:
        """`(start in this rank's rows, start in the checkpoint tensor's rows, rows)` of a shard."""
        return 0, 0, self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        dst, src, size = self.shard_offsets(shard_id)
        _copy(param.data.narrow(0, dst, size), _narrow(loaded, 0, src, size, shard_id))

    def block_weight_loader(self, rows: torch.Tensor, qtype: int, max_tokens: int, shard_id=None) -> None:
        """Place one shard's GGUF block rows (each shard in its own block type)."""
        dst, src, size = self.shard_offsets(shard_id)
        rows = _narrow(rows, 0, src, size, shard_id)
        if self.block_weight is None:
            self.block_weight = BlockWeight([], max_tokens)
        self.block_weight.add(dst, rows, qtype)


class ColumnParallelLinear(Linear):
    """Output rows split over the ranks: rank r holds rows `[r * n, (r + 1) * n)`."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        _check_divisible("output features", output_size, tp_size)
        super().__init__(input_size, output_size // tp_size, bias)

    def shard_offsets(self, shard_id) -> tuple[int, int, int]:
        return 0, self.tp_rank * self.output_size, self.output_size


class MergedColumnParallelLinear(Linear):
    """Several column-parallel projections of the same input in one matmul (gate_up_proj);
    shards 0, 1, ...: each rank holds its slice of every one, one after the other."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        for size in output_sizes:
            _check_divisible("output features", size, tp_size)
        self.total_output_sizes = list(output_sizes)  # the checkpoint's
        self.output_sizes = [size // tp_size for size in output_sizes]  # this rank's
        super().__init__(input_size, sum(self.output_sizes), bias)

    def shard_offsets(self, shard_id) -> tuple[int, int, int]:
        if shard_id is None:
            if self.tp_size > 1:
                raise ValueError("a fused checkpoint tensor cannot be split over TP ranks")
            return 0, 0, self.output_size
        size = self.output_sizes[shard_id]
        return sum(self.output_sizes[:shard_id]), self.tp_rank * size, size


class QKVParallelLinear(Linear):
    """q, k and v projections in one matmul; shards "q", "k", "v". The key/value heads are split
    over the ranks, each with the query heads that read it (`head_ranges`); with fewer key/value
    heads than ranks each one is replicated on the `tp_size / num_kv_heads` ranks that split its
    query heads."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = get_tp_group()
        (self.q_head_start, self.num_heads), (self.kv_head_start, self.num_kv_heads) = head_ranges(
            num_heads, num_kv_heads, tp.world_size, tp.rank
        )
        self.head_size = head_size
        self.q_size, self.kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        self.total_q_size, self.total_kv_size = num_heads * head_size, num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    @property
    def q_range(self) -> tuple[int, int]:
        """This rank's query features `(start, size)`: the input columns of the matching o_proj."""
        return self.q_head_start * self.head_size, self.q_size

    def shard_offsets(self, shard_id) -> tuple[int, int, int]:
        if shard_id is None:
            if self.tp_size > 1:
                raise ValueError("a fused checkpoint tensor cannot be split over TP ranks")
            return 0, 0, self.output_size
        if shard_id == "q":
            return 0, self.q_head_start * self.head_size, self.q_size
        dst = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return dst, self.kv_head_start * self.head_size, self.kv_size


class RowParallelLinear(Linear):
    """Input columns split over the ranks (the input is the matching slice of a column-parallel
    output); the partial products are summed over the ranks, then the bias is added once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_range: tuple[int, int] | None = None,
    ) -> None:
        """`input_range`: this rank's input columns `(start, size)`; default an even split."""
        tp = get_tp_group()
        if input_range is None:
            _check_divisible("input features", input_size, tp.world_size)
            size = input_size // tp.world_size
            input_range = (tp.rank * size, size)
        self.input_start = input_range[0]
        self.total_input_size = input_size  # the checkpoint's
        super().__init__(input_range[1], output_size, bias)

    def accepts_amx_weight(self) -> bool:
        return self.tp_size == 1  # the ranks' partial products are summed in float32 (below)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        if _reduce_in_float32(x):
            partial = F.linear(x.float(), self._float32_weight())
        else:
            partial = block_linear(x, self.weight, self.block_weight)
        if self.output_delta is not None:
            partial = self.output_delta(x, partial)
        y = tensor_model_parallel_all_reduce(partial).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _float32_weight(self) -> torch.Tensor:
        """The weight as float32 (kept after the first call): 16-bit weights hold exact float32
        values and their products are exact, so a float32 matmul sums what a 16-bit one sums."""
        if getattr(self, "_weight_f32", None) is None:
            self._weight_f32 = self.weight.float()
        return self._weight_f32

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:
            _copy(param.data, loaded)
        else:
            _copy(param.data, _narrow(loaded, 1, self.input_start, self.input_size, shard_id))

    def block_weight_loader(self, rows: torch.Tensor, qtype: int, max_tokens: int, shard_id=None) -> None:
        """Each rank's columns as whole GGUF blocks; a slice that would cut a block raises
        `BlockShardError` (the layer then computes with its float weight)."""
        if self.tp_size > 1:
            from radixengine.layers.gguf_quant_ops import BLOCK_BYTES, BLOCK_WEIGHTS

            block_size, block_bytes = BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]
            if self.input_size % block_size or self.input_start % block_size:
                raise BlockShardError(
                    f"input features [{self.input_start}, {self.input_start + self.input_size}) of this rank "
                    f"are not whole {block_size}-weight GGUF blocks"
                )
            width = self.input_size // block_size * block_bytes
            rows = rows.narrow(1, self.input_start // block_size * block_bytes, width).contiguous()
        super().block_weight_loader(rows, qtype, max_tokens, shard_id)


def _reduce_in_float32(x: torch.Tensor) -> bool:
    """A 16-bit model on a CPU sums the ranks' partial products in float32 and rounds once, as
    the single-rank matmul (float32 accumulation) does: rounding each partial to 16 bits first
    would make the tokens drift from one rank's after a few dozen steps. (On CUDA the partials
    are summed in the model's dtype, as SGLang does.)"""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


class BlockShardError(ValueError):
    """A GGUF block weight that cannot be split over the TP ranks in whole blocks."""


def head_ranges(
    num_heads: int, num_kv_heads: int, tp_size: int, rank: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """`((first query head, query heads), (first key/value head, key/value heads))` of `rank`.

    With at least as many key/value heads as ranks, rank r holds key/value heads
    `[K * r // tp, K * (r + 1) // tp)` and their query heads (an uneven split when tp does not
    divide K: 3 heads over 2 ranks are 1 and 2). With fewer, each key/value head is replicated on
    `tp / K` ranks, which split its query heads evenly."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} key/value heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start = num_kv_heads * rank // tp_size
        kv_count = num_kv_heads * (rank + 1) // tp_size - kv_start
        return (kv_start * group, kv_count * group), (kv_start, kv_count)
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(
            f"--tp-size {tp_size} exceeds the model's {num_kv_heads} key/value heads: it must then be a "
            f"multiple of them ({num_kv_heads}) whose ratio ({tp_size} / {num_kv_heads}) divides the "
            f"{group} query heads of each key/value head"
        )
    q_count = group // replicas
    return (rank * q_count, q_count), (rank // replicas, 1)


def _check_divisible(what: str, n: int, tp_size: int) -> None:
    if n % tp_size:
        raise ValueError(f"the model's {n} {what} cannot be split evenly over --tp-size {tp_size} ranks")


def _narrow(t: torch.Tensor, dim: int, start: int, size: int, shard_id) -> torch.Tensor:
    if start == 0 and t.shape[dim] == size:
        return t
    if t.shape[dim] < start + size:
        name = "" if shard_id is None else f" (shard {shard_id!r})"
        raise ValueError(
            f"weight shape {tuple(t.shape)}{name} has no rows [{start}, {start + size}) on dim {dim}"
        )
    return t.narrow(dim, start, size).contiguous()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not match parameter {tuple(dst.shape)}")
    dst.copy_(src)
