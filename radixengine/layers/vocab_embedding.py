"""Token embedding and LM head (the head may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixengine.layers.linear import BlockWeight


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        # GGUF blocks of the weight, used when it serves as the LM head (see linear.BlockWeight).
        self.block_weight: BlockWeight | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def block_weight_loader(self, rows: torch.Tensor, qtype: int, max_tokens: int, shard_id=None) -> None:
        if rows.shape[0] != self.num_embeddings:
            raise ValueError(f"GGUF rows {tuple(rows.shape)} do not match {self.num_embeddings} embeddings")
        self.block_weight = BlockWeight.of(rows.contiguous(), qtype, max_tokens)


class LMHead(VocabEmbedding):
    """Holds the output projection; the LogitsProcessor applies it to the selected hidden states."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LMHead is applied by LogitsProcessor")
