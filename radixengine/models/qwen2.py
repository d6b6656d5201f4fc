"""Qwen2ForCausalLM: Llama with a bias on the q/k/v projections."""

from __future__ import annotations

from radixengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2Attention(LlamaAttention):
    def qkv_bias(self, config) -> bool:
        return True

    def o_bias(self, config) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model


EntryClass = [Qwen2ForCausalLM]
