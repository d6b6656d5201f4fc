"""Logits of the last token of each request (EXTEND) or of each decoded token (DECODE); for the
requests that ask for prompt logprobs, also the logprobs of their prompt tokens (SGLang's input
logprobs: log_softmax of the raw logits, no temperature), computed only at the positions asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixengine.layers.forward_logprobs import ForwardLogprobs

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import ForwardBatchView
    from radixengine.layers.vocab_embedding import VocabEmbedding

# Prompt positions whose full-vocabulary logits are held at once while taking input logprobs.
INPUT_LOGPROB_CHUNK_ROWS = 1024
_FLOAT32_MIN = torch.finfo(torch.float32).min


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # float32 [bs, vocab]
    # Filled by the sampler: bool [bs], the rows whose logits had nothing to sample (all NaN or
    # -inf); None when every row was fine.
    invalid_rows: torch.Tensor | None = None
    # The chosen tokens' logprobs (filled by the sampler when the batch asks for them) and, in an
    # EXTEND with input logprobs, one row per prompt position asked (ForwardBatch.
    # input_logprob_indices): the logprob of the prompt token that follows it, and the top
    # max(top_logprobs_nums) there when a request asks for them.
    logprobs: ForwardLogprobs[torch.Tensor] = field(default_factory=ForwardLogprobs)


class LogitsProcessor(nn.Module):
    """`final_logit_softcapping` (Gemma 2): every logit becomes `cap * tanh(logit / cap)`."""

    def __init__(self, vocab_size: int, final_logit_softcapping: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.final_logit_softcapping = final_logit_softcapping or None

    def forward(
        self, hidden_states: torch.Tensor, lm_head: VocabEmbedding, forward_batch: ForwardBatchView
    ) -> LogitsProcessorOutput:
        states = hidden_states
        if forward_batch.forward_mode.has_extend_layout():
            states = hidden_states.index_select(0, forward_batch.last_token_indices())
        out = LogitsProcessorOutput(next_token_logits=self._logits(states, lm_head))
        if forward_batch.forward_mode.is_extend() and forward_batch.input_logprob_indices is not None:
            top = max(forward_batch.top_logprobs_nums or [0])
            self._input_logprobs(hidden_states, lm_head, forward_batch, top, out)
        return out

    def _input_logprobs(
        self,
        hidden_states: torch.Tensor,
        lm_head: VocabEmbedding,
        forward_batch: ForwardBatchView,
        top: int,
        out: LogitsProcessorOutput,
    ) -> None:
        rows, targets = forward_batch.input_logprob_indices, forward_batch.input_logprob_token_ids
        token_lps, top_vals, top_ids = [], [], []
        for start in range(0, rows.numel(), INPUT_LOGPROB_CHUNK_ROWS):
            chunk = slice(start, start + INPUT_LOGPROB_CHUNK_ROWS)
            logits = self._logits(hidden_states.index_select(0, rows[chunk]), lm_head)
            logprobs = torch.log_softmax(logits, dim=-1)
            logprobs.clamp_(min=_FLOAT32_MIN)
            token_lps.append(logprobs.gather(1, targets[chunk].view(-1, 1)).view(-1))
            if top > 0:
                values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
                top_vals.append(values)
                top_ids.append(indices)
        device = hidden_states.device
        out.logprobs.input_token_logprobs = (
            torch.cat(token_lps) if token_lps else torch.empty(0, device=device)
        )
        if top > 0:
            empty = torch.empty((0, top), device=device)
            out.logprobs.input_top_logprobs_val = torch.cat(top_vals) if top_vals else empty
            out.logprobs.input_top_logprobs_idx = torch.cat(top_ids) if top_ids else empty.long()

    def _logits(self, states: torch.Tensor, lm_head: VocabEmbedding) -> torch.Tensor:
        logits = lm_head.gather_logits(lm_head.project(states)).float()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
