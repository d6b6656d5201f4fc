"""Gemma3ForCausalLM (text only, `gemma3_text`): Gemma 2's layer with an RMSNorm over each q and
k head, five sliding-window layers to one global (`layer_types`), a rope theta of their own for
the local layers, and no attention soft-capping (HF applies none)."""

from __future__ import annotations

import torch

from radixengine.layers.layernorm import GemmaRMSNorm
from radixengine.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_config
from radixengine.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def make_rotary_emb(self, config, layer_id: int) -> RotaryEmbedding:
        theta, scaling = rope_config(config, config.layer_types[layer_id])
        return get_rope(self.head_dim, self.head_dim, config.max_position_embeddings, theta, scaling)

    def logit_cap(self, config) -> float:
        return 0.0

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model


EntryClass = [Gemma3ForCausalLM]
