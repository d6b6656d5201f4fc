"""Qwen3MoeForCausalLM: Qwen3 (per-head q/k RMSNorm) whose MLPs are sparse MoE blocks of top-k
routed experts, without Qwen2-MoE's shared expert."""

from __future__ import annotations

from torch import nn

from radixengine.layers.moe import FusedMoE
from radixengine.models.llama import LlamaModel
from radixengine.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM, fused_moe_args
from radixengine.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention

    def sparse_block(self, config) -> nn.Module:
        return FusedMoE(**fused_moe_args(config))


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    supports_tp = False  # the experts are not split over ranks
    model_cls = Qwen3MoeModel


EntryClass = [Qwen3MoeForCausalLM]
