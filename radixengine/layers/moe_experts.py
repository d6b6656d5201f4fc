"""The routed experts of a MoE layer: each token through its top-k experts' SiLU-gated MLPs, the
outputs summed with the routing weights.

Weights are stacked per expert in `[in, out]` layout: `w13 [E, hidden, 2 * inter]` (gate then up)
and `w2 [E, inter, hidden]`. Every path sorts the token-expert pairs by expert once (argsort and
bincount) and computes each expert's group of rows at once:

- `fused_experts_native`: the native CPU kernel (`radixengine/csrc/cpu_moe.cpp`) multiplies each
  group by its expert's weight read in place;
- `fused_experts_grouped`: pure torch, the groups padded to the largest one and multiplied with
  `torch.bmm` (every expert's weight when most are hit, else a copy of those that are);
- `fused_experts_naive`: one Python iteration per expert, as transformers computes it; the
  reference of the tests and the benchmark.

`fused_experts` picks the native kernel on a CPU when it is built, else the grouped torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixengine.layers.activation import SiluAndMul
from radixengine.layers.attention import native_cpu_ops

__all__ = [
    "ExpertGroups",
    "fused_experts",
    "fused_experts_grouped",
    "fused_experts_naive",
    "fused_experts_native",
    "moe_native_available",
    "sort_by_expert",
]

# The grouped torch path multiplies every expert's weight (padding the idle ones' groups) rather
# than copying the weights of those hit, when at least this fraction of the experts is hit: a copy
# reads and writes a weight before the matmul reads it again.
ALL_EXPERTS_MIN_HIT_FRACTION = 1 / 3
# The native kernel writes its columns in vectors of up to 16 floats.
NATIVE_COLUMN_MULTIPLE = 16

_act = SiluAndMul()


_native = native_cpu_ops.native_module_with("moe_grouped_linear")


def moe_native_available() -> bool:
    """True when the native extension is built with the grouped expert kernel."""
    return _native is not None


@dataclass
class ExpertGroups:
    """The token-expert pairs (`T * top_k` of them) sorted by expert."""

    order: torch.Tensor  # [T * top_k] index into the flattened topk_ids, grouped by expert
    token: torch.Tensor  # [T * top_k] the token of each sorted pair
    expert: torch.Tensor  # [T * top_k] the expert of each sorted pair (ascending)
    counts: torch.Tensor  # [E] pairs per expert
    offsets: torch.Tensor  # [E + 1] where each expert's group starts in the sorted pairs


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    # not bincount: on CUDA it reads the ids' range back to the host, which CUDA-graph capture forbids
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return ExpertGroups(order, order // topk_ids.shape[1], flat[order], counts, offsets)


def _combine(
    y: torch.Tensor, groups: ExpertGroups, topk_weights: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """Sum each token's expert outputs `y` (sorted pairs) with their routing weights."""
    y = y * topk_weights.flatten()[groups.order].unsqueeze(1).to(y.dtype)
    out = torch.zeros(num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    return out.index_add_(0, groups.token, y).to(dtype)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    if _native_applies(hidden, w13, w2):
        return fused_experts_native(hidden, w13, w2, topk_weights, topk_ids)
    return fused_experts_grouped(hidden, w13, w2, topk_weights, topk_ids)


def _native_applies(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return (
        _native is not None
        and hidden.is_cpu
        and w13.dtype == w2.dtype
        and w13.dtype in (torch.float32, torch.bfloat16)
        and w13.shape[2] % NATIVE_COLUMN_MULTIPLE == 0
        and w2.shape[2] % NATIVE_COLUMN_MULTIPLE == 0
    )


def fused_experts_native(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    if _native is None:
        raise RuntimeError(
            "the native MoE kernel is not built: " + str(native_cpu_ops.native_unavailable_reason())
        )
    groups = sort_by_expert(topk_ids, w13.shape[0])
    x = hidden.index_select(0, groups.token).float()
    gate_up = _native.moe_grouped_linear(x, w13, groups.offsets)
    y = _native.moe_grouped_linear(_act(gate_up), w2, groups.offsets)
    return _combine(y, groups, topk_weights, hidden.shape[0], hidden.dtype)


def fused_experts_grouped(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    static_shapes: bool | None = None,
) -> torch.Tensor:
    """`static_shapes` (default: while a CUDA graph is being captured): no host sync, every
    expert's group padded to the number of tokens (a token picks an expert at most once)."""
    if static_shapes is None:
        static_shapes = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    num_experts, hidden_size, inter2 = w13.shape
    groups = sort_by_expert(topk_ids, num_experts)
    group_of = torch.arange(num_experts, device=hidden.device)
    if static_shapes:
        rows = hidden.shape[0]
    else:
        rows = int(groups.counts.max())
        hit = groups.counts.nonzero().flatten()
        if hit.numel() < ALL_EXPERTS_MIN_HIT_FRACTION * num_experts:
            group_of[hit] = torch.arange(hit.numel(), device=hidden.device)
            w13, w2 = w13.index_select(0, hit), w2.index_select(0, hit)
    pos = torch.arange(groups.token.numel(), device=hidden.device) - groups.offsets[groups.expert]
    slot = group_of[groups.expert] * rows + pos
    x = hidden.new_zeros(w13.shape[0] * rows, hidden_size)
    x.index_copy_(0, slot, hidden.index_select(0, groups.token))
    gate_up = torch.bmm(x.view(-1, rows, hidden_size), w13)
    act = _act(gate_up.view(-1, inter2)).view(-1, rows, inter2 // 2)
    y = torch.bmm(act, w2).view(-1, hidden_size).index_select(0, slot)
    return _combine(y, groups, topk_weights, hidden.shape[0], hidden.dtype)


def fused_experts_naive(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for e in range(w13.shape[0]):
        token, k = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        gate, up = (hidden[token] @ w13[e]).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e]
        out.index_add_(0, token, y * topk_weights[token, k, None])
    return out
