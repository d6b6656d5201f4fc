"""Logits of the last token of each request (EXTEND) or of each decoded token (DECODE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixengine.layers.linear import block_linear

if TYPE_CHECKING:
    from radixengine.layers.vocab_embedding import VocabEmbedding
    from radixengine.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # float32 [bs, vocab]
    # Filled by the sampler when the batch asks for logprobs: logprob of each chosen token [bs].
    next_token_logprobs: torch.Tensor | None = None
    # Filled by the sampler: bool [bs], the rows whose logits had nothing to sample (all NaN or
    # -inf); None when every row was fine.
    invalid_rows: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self, hidden_states: torch.Tensor, lm_head: VocabEmbedding, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        if forward_batch.forward_mode.is_extend():
            hidden_states = hidden_states.index_select(0, forward_batch.last_token_indices())
        logits = block_linear(hidden_states, lm_head.weight, lm_head.block_weight)
        return LogitsProcessorOutput(next_token_logits=logits.float())
