"""MixtralForCausalLM: Mistral's attention (Llama's, with its sliding window) and, on every
layer, a sparse MoE block: top-k of the softmax router, renormalized, no shared expert. Qwen-MoE's
FusedMoE under Mixtral's checkpoint names (`block_sparse_moe`, experts' `w1` gate, `w3` up, `w2`
down)."""

from __future__ import annotations

from torch import nn

from radixengine.layers.layernorm import RMSNorm
from radixengine.layers.moe import MIXTRAL_EXPERT_PARTS, FusedMoE
from radixengine.models.llama import LlamaDecoderLayer, LlamaModel
from radixengine.models.qwen2_moe import Qwen2MoeForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_id: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.attention_cls(config, layer_id)
        self.block_sparse_moe = FusedMoE(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            expert_parts=MIXTRAL_EXPERT_PARTS,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:
        """The block LlamaDecoderLayer.forward runs after attention."""
        return self.block_sparse_moe


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(Qwen2MoeForCausalLM):
    model_cls = MixtralModel
    expert_parts = MIXTRAL_EXPERT_PARTS


EntryClass = [MixtralForCausalLM]
