"""Gemma2ForCausalLM: attention and final logits soft-capped, sliding-window layers alternating
with global ones, GeGLU (tanh GELU), embeddings scaled by sqrt(hidden_size), RMSNorms scaled by
`1 + weight`, a norm before and after both the attention and the MLP, attention scaled by
`query_pre_attn_scalar ** -0.5`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixengine.layers.activation import GeluAndMul, gelu_approximation
from radixengine.layers.layernorm import GemmaRMSNorm
from radixengine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixengine.layers.vocab_embedding import VocabEmbedding
from radixengine.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import ForwardBatchView


class Gemma2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = GeluAndMul(gelu_approximation(hidden_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(LlamaAttention):
    def attn_scaling(self, config) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5

    def logit_cap(self, config) -> float:
        return float(getattr(config, "attn_logit_softcapping", None) or 0.0)


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = Gemma2MLP(config.hidden_size, config.intermediate_size, act)
        norm = lambda: GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatchView,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma2Model(nn.Module):
    layer_cls = Gemma2DecoderLayer

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an encoder) is not supported")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.embed_scale = float(config.hidden_size) ** 0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatchView
    ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        # The scale rounded to the model's dtype first, as HF does.
        hidden_states = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma2Model


EntryClass = [Gemma2ForCausalLM]
