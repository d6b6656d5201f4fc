"""Phi3ForCausalLM: Phi-3 and Phi-4-mini. Llama with q/k/v and gate/up fused in the checkpoint
itself, longrope scaling (short or long factors by sequence length) and, in Phi-4-mini, a
partial rotary embedding; a sliding window over every layer when the config sets one."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixengine.models.llama import LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import ForwardBatchView


class Phi3Model(LlamaModel):
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatchView
    ) -> torch.Tensor:
        # Every layer shares one rotary embedding; with longrope it picks its cache rows per request.
        rope = self.layers[0].self_attn.rotary_emb
        return super().forward(input_ids, rope.cache_positions(positions, forward_batch), forward_batch)


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model
    # qkv_proj and gate_up_proj come fused in the checkpoint: loaded whole (not split over ranks).
    stacked_params_mapping = []
    supports_tp = False


EntryClass = [Phi3ForCausalLM]
