"""Qwen2MoeForCausalLM: Qwen2 whose MLPs are sparse MoE blocks (top-k routed experts plus a
shared expert under a sigmoid gate) on the layers `decoder_sparse_step` / `mlp_only_layers` pick."""

from __future__ import annotations

import torch
from torch import nn

from radixengine.layers.layernorm import RMSNorm
from radixengine.layers.linear import Linear
from radixengine.layers.moe import EXPERT_PARTS, FusedMoE, FusedMoEExperts, expert_param_for
from radixengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def is_sparse_layer(config, layer_id: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % step == 0
    )


def fused_moe_args(config) -> dict:
    return dict(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
    )


class Qwen2MoeSparseMoeBlock(FusedMoE):
    def __init__(self, config) -> None:
        super().__init__(**fused_moe_args(config))
        self.shared_expert = LlamaMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(config.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return super().forward(hidden) + shared


class Qwen2MoeAttention(LlamaAttention):
    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    def o_bias(self, config) -> bool:
        return False


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2MoeAttention

    def __init__(self, config, layer_id: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.attention_cls(config, layer_id)
        if is_sparse_layer(config, layer_id):
            self.mlp = self.sparse_block(config)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def sparse_block(self, config) -> nn.Module:
        return Qwen2MoeSparseMoeBlock(config)


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    supports_tp = False  # the experts are not split over ranks
    model_cls = Qwen2MoeModel
    expert_parts = EXPERT_PARTS

    def expected_weight_names(self) -> set[str]:
        names = {n for n in super().expected_weight_names() if ".experts.w" not in n}
        for module_name, module in self.named_modules():
            if isinstance(module, FusedMoEExperts):
                names |= module.expected_names(module_name)
        return names

    def _param_for(self, name: str) -> tuple[str, object]:
        return expert_param_for(name, self.expert_parts) or super()._param_for(name)


EntryClass = [Qwen2MoeForCausalLM]
