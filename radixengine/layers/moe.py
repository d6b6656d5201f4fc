"""A mixture-of-experts MLP: a softmax router picks each token's top-k experts, whose SiLU-gated
MLPs (`moe_experts.fused_experts`) run on it and are summed with the routing weights.

The experts' weights load from per-expert checkpoint tensors (`experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`, each `[out, in]`; Mixtral's `w1`, `w3`, `w2`) into two stacked parameters
in `[in, out]` layout: `w13_weight [E, hidden, 2 * inter]` (gate columns then up) and
`w2_weight [E, inter, hidden]`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from radixengine.layers.linear import Linear
from radixengine.layers.moe_experts import fused_experts

# checkpoint part -> (stacked parameter, shard: 0 gate, 1 up, None whole)
ExpertParts = dict[str, tuple[str, int | None]]
EXPERT_PARTS: ExpertParts = {
    "gate_proj": ("w13_weight", 0),
    "up_proj": ("w13_weight", 1),
    "down_proj": ("w2_weight", None),
}
MIXTRAL_EXPERT_PARTS: ExpertParts = {
    "w1": ("w13_weight", 0),
    "w3": ("w13_weight", 1),
    "w2": ("w2_weight", None),
}


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax over experts (fp32), renormalized to sum to 1 when asked; returns
    (weights in the logits' dtype, expert ids)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def expert_param_for(
    name: str, parts: ExpertParts = EXPERT_PARTS
) -> tuple[str, tuple[int, int | None]] | None:
    """`...mlp.experts.3.up_proj.weight` -> (`...mlp.experts.w13_weight`, (3, 1)); None for a
    name that is not a routed expert's."""
    match = re.search(rf"\.experts\.(\d+)\.({'|'.join(parts)})\.weight$", name)
    if match is None:
        return None
    param, shard = parts[match.group(2)]
    return f"{name[: match.start()]}.experts.{param}", (int(match.group(1)), shard)


class FusedMoEExperts(nn.Module):
    """The stacked weights of the routed experts."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, parts: ExpertParts = EXPERT_PARTS
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.parts = parts  # the checkpoint's names of each expert's weights
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, 2 * intermediate_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, intermediate_size, hidden_size), requires_grad=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]
    ) -> None:
        expert, shard = shard_id
        dst = param.data[expert]
        if shard is not None:
            dst = dst.narrow(1, shard * self.intermediate_size, self.intermediate_size)
        if dst.shape != loaded.t().shape:
            raise ValueError(f"expert weight shape {tuple(loaded.shape)} does not fit {tuple(dst.t().shape)}")
        dst.copy_(loaded.t())

    def expected_names(self, prefix: str) -> set[str]:
        """The per-expert checkpoint names these parameters load from."""
        return {f"{prefix}.{e}.{part}.weight" for e in range(self.num_experts) for part in self.parts}

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    """Router (`gate`, `[E, hidden]`) and routed experts (`experts`) of a sparse MoE block."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        expert_parts: ExpertParts = EXPERT_PARTS,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoEExperts(num_experts, hidden_size, intermediate_size, expert_parts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.experts(hidden, topk_weights, topk_ids)
