"""Draft trees of a batch as tensors, and the geometry of their verify extend.

Every request of a verify step has a draft tree (a chain is a tree): node 0 is its root, the last
token it sampled (no KV yet), nodes 1.. the drafted tokens, each after its parent. The batch is
padded to `n` nodes a row; `num_nodes` says how many are real. The verify extend writes the KV of
every real node; node j sits at position `prefix_len + depth(j)` and attends to the request's
cached prefix and to its ancestors in the tree and itself (`tree_mask`). After verification the
accepted path's KV is moved to the slots of positions `prefix_len .. prefix_len + accept_len` and
the other slots are freed (`accepted_kv_moves`); for a chain nothing moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftTrees:
    tokens: torch.Tensor  # int64 [bs, n]; padding nodes hold 0
    parents: torch.Tensor  # int64 [bs, n]; -1 for the root, 0 for padding nodes
    num_nodes: torch.Tensor  # int64 [bs]: real nodes per row, 1..n
    num_nodes_cpu: list[int]
    is_chain: bool  # every row is a chain: parents[j] = j - 1

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def from_drafts(
        cls, drafts: Sequence[tuple[np.ndarray, np.ndarray]], width: int, device: torch.device | str = "cpu"
    ) -> DraftTrees:
        """From per-request (tokens, parents) arrays (e.g. `NgramDraft`), padded to `width`."""
        bs = len(drafts)
        tokens = np.zeros((bs, width), dtype=np.int64)
        parents = np.zeros((bs, width), dtype=np.int64)
        counts = []
        for row, (tok, par) in enumerate(drafts):
            if not 1 <= len(tok) <= width or len(par) != len(tok):
                raise ValueError(f"row {row}: {len(tok)} nodes for a width of {width}")
            tokens[row, : len(tok)] = tok
            parents[row, : len(tok)] = par
            counts.append(len(tok))
        _check_parents(parents, counts)
        chain = all(np.array_equal(parents[r, : counts[r]], np.arange(-1, counts[r] - 1)) for r in range(bs))
        return cls(
            torch.from_numpy(tokens).to(device),
            torch.from_numpy(parents).to(device),
            torch.tensor(counts, dtype=torch.int64, device=device),
            counts,
            chain,
        )

    @classmethod
    def chains(cls, tokens: torch.Tensor, num_nodes: Sequence[int]) -> DraftTrees:
        """Chains: `tokens` [bs, n] with the root in column 0 (e.g. a draft model's proposals)."""
        bs, n = tokens.shape
        parents = (torch.arange(n, device=tokens.device) - 1).expand(bs, n).clone()
        counts = torch.tensor(list(num_nodes), dtype=torch.int64, device=tokens.device)
        return cls(tokens, parents, counts, list(num_nodes), True)

    def valid(self) -> torch.Tensor:
        """bool [bs, n]: real nodes."""
        return torch.arange(self.width, device=self.tokens.device) < self.num_nodes.view(-1, 1)

    def depths(self) -> torch.Tensor:
        """int64 [bs, n]: node depth, root 0 (padding nodes: 0)."""
        if self.is_chain:
            return (
                torch.arange(self.width, device=self.tokens.device).expand(self.batch_size, -1) * self.valid()
            )
        depth = torch.zeros_like(self.tokens)
        for j in range(1, self.width):
            depth[:, j] = depth.gather(1, self.parents[:, j : j + 1].clamp(min=0)).view(-1) + 1
        return depth * self.valid()

    def ancestors(self) -> torch.Tensor:
        """bool [bs, n, n]: [b, j, a] when node a is node j or one of its ancestors (real nodes
        only). This is the attention mask among a request's draft tokens."""
        bs, n = self.tokens.shape
        eye = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        if self.is_chain:
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=self.tokens.device))
            anc = mask.expand(bs, n, n).clone()
        else:
            anc = eye.expand(bs, n, n).clone()
            rows = torch.arange(bs, device=self.tokens.device)
            for j in range(1, n):
                anc[:, j] |= anc[rows, self.parents[:, j].clamp(min=0)]
        valid = self.valid()
        return anc & valid[:, :, None] & valid[:, None, :]


def _check_parents(parents: np.ndarray, counts: list[int]) -> None:
    for row, count in enumerate(counts):
        par = parents[row, :count]
        if par[0] != -1 or (count > 1 and not (par[1:] < np.arange(1, count)).all()) or (par[1:] < 0).any():
            raise ValueError(
                f"row {row}: the root must be node 0 and every parent must come before its child"
            )


def tree_mask(trees: DraftTrees) -> torch.Tensor:
    """bool [bs, n, n]: which draft nodes each draft node attends to (besides the prefix)."""
    return trees.ancestors()


def verify_positions(trees: DraftTrees, prefix_lens: torch.Tensor) -> torch.Tensor:
    """int64 [bs, n]: the position of every node in the verify extend (the root's is the
    request's current length, `prefix_lens`: the tokens with KV)."""
    return prefix_lens.view(-1, 1) + trees.depths()


def flatten_verify_inputs(trees: DraftTrees, prefix_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, positions) of the verify extend, int64 [sum(num_nodes)]: each request's real
    nodes in node order (a ragged EXTEND with `extend_seq_lens = num_nodes`)."""
    valid = trees.valid()
    return trees.tokens[valid], verify_positions(trees, prefix_lens)[valid]


def custom_mask(trees: DraftTrees, prefix_lens: Sequence[int]) -> torch.Tensor:
    """SGLang's flattened `custom_mask` (bool): per request a row-major [num_nodes, prefix_len +
    num_nodes] block, its prefix all visible, the tree part `tree_mask`; blocks concatenated."""
    anc = trees.ancestors()
    blocks = []
    for row, (count, prefix) in enumerate(zip(trees.num_nodes_cpu, prefix_lens)):
        visible = torch.ones(count, prefix, dtype=torch.bool, device=anc.device)
        blocks.append(torch.cat([visible, anc[row, :count, :count]], dim=1).reshape(-1))
    return torch.cat(blocks)


def accepted_kv_moves(
    trees: DraftTrees, out_cache_loc: torch.Tensor, path_nodes: torch.Tensor, accept_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After a verify step: `(src, dst, free)` KV slots. `out_cache_loc` int64 [bs, n] is the slot
    of every node (node order), `path_nodes` [bs, n] the node at each depth of the accepted path
    (-1 past `accept_lens`). The KV at `src` must be copied to `dst` (the slots of positions
    0..accept_len, so the request's slots stay in position order, as pages need), then `free`
    (the slots of the positions past the accepted path) returned to the allocator."""
    n = trees.width
    col = torch.arange(n, device=out_cache_loc.device)
    kept = col <= accept_lens.view(-1, 1)
    src = out_cache_loc.gather(1, path_nodes.clamp(min=0))
    moved = kept & (src != out_cache_loc)
    freed = ~kept & trees.valid()
    return src[moved], out_cache_loc[moved], out_cache_loc[freed]


def pad_verify_logits(logits: torch.Tensor, trees: DraftTrees) -> torch.Tensor:
    """The verify extend's logits, one row per real node in request order ([sum(num_nodes),
    vocab], as `flatten_verify_inputs` laid the tokens out), as [bs, n, vocab]; padding nodes get
    zeros (never accepted, never read for an output)."""
    valid = trees.valid()
    out = logits.new_zeros((trees.batch_size, trees.width, logits.shape[-1]))
    out[valid] = logits
    return out
