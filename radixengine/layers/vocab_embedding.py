"""Token embedding and LM head (the head may share the embedding's weight), split over the
tensor-parallel ranks by vocabulary rows (SGLang's VocabParallelEmbedding / ParallelLMHead).

The vocabulary is padded to a multiple of the rank count; rank r holds rows
`[r * n, (r + 1) * n)` of the padded table (rows past the real vocabulary are zero). The
embedding looks up the ids in its rows, zeroes the others and sums over the ranks; the head's
logits are gathered from every rank and the padding cut off (`gather_logits`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixengine.distributed import (
    get_tp_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from radixengine.layers.linear import BlockWeight, block_linear
from radixengine.layers.packed_weight import PackedWeight


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.num_embeddings = num_embeddings  # the real vocabulary, all ranks
        self.embedding_dim = embedding_dim
        rows = pad_vocab_size(num_embeddings, self.tp_size) // self.tp_size
        self.vocab_start = self.tp_rank * rows
        self.vocab_end = min(self.vocab_start + rows, num_embeddings)  # real rows of this rank end here
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        # GGUF blocks of the weight, used when it serves as the LM head (see linear.BlockWeight).
        self.block_weight: BlockWeight | None = None
        self.amx_weight: PackedWeight | None = None  # packed for the LM head's use

    def accepts_amx_weight(self) -> bool:
        return False  # a table for lookups: packed only where it is the model's (tied) LM head

    def keeps_float_weight(self) -> bool:
        return True  # the embedding reads it

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's logits `hidden_states @ weight.T` (the LM head's use of the table)."""
        if self.amx_weight is not None:
            return self.amx_weight.linear(hidden_states)
        return block_linear(hidden_states, self.weight, self.block_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(out)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary from each rank's `[.., rows]` part."""
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.num_embeddings]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"embedding shape {tuple(loaded.shape)} does not match "
                f"({self.num_embeddings}, {self.embedding_dim})"
            )
        real = self.vocab_end - self.vocab_start
        param.data[:real].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[real:].zero_()

    def block_weight_loader(self, rows: torch.Tensor, qtype: int, max_tokens: int, shard_id=None) -> None:
        if rows.shape[0] != self.num_embeddings:
            raise ValueError(f"GGUF rows {tuple(rows.shape)} do not match {self.num_embeddings} embeddings")
        mine = rows[self.vocab_start : self.vocab_end]
        padding = self.weight.shape[0] - mine.shape[0]
        if padding:  # all-zero blocks dequantize to zero weights in every GGUF block type
            mine = torch.cat([mine, mine.new_zeros(padding, mine.shape[1])])
        self.block_weight = BlockWeight.of(mine.contiguous(), qtype, max_tokens)


class LMHead(VocabEmbedding):
    """Holds the output projection; the LogitsProcessor applies it to the selected hidden states."""

    def keeps_float_weight(self) -> bool:
        return False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LMHead is applied by LogitsProcessor")
