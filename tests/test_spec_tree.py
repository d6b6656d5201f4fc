"""Draft-tree geometry: the ancestor mask, node depths and positions, the flattened custom mask,
the KV moves after acceptance, and a toy attention layer whose tree-verify output equals running
each path on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixengine.speculative.spec_tree import (
    DraftTrees,
    accepted_kv_moves,
    custom_mask,
    flatten_verify_inputs,
    tree_mask,
    verify_positions,
)

# root -> 1 -> 3 -> 4, root -> 2 -> 5; second row a chain of 3 nodes (padded to 6)
TREE = (np.array([9, 1, 2, 3, 4, 5]), np.array([-1, 0, 0, 1, 3, 2]))
CHAIN = (np.array([7, 6, 5]), np.array([-1, 0, 1]))


def _trees() -> DraftTrees:
    return DraftTrees.from_drafts([TREE, CHAIN], 6)


def test_mask_depths_positions() -> None:
    trees = _trees()
    assert not trees.is_chain and trees.num_nodes_cpu == [6, 3]
    assert trees.depths().tolist() == [[0, 1, 1, 2, 3, 2], [0, 1, 2, 0, 0, 0]]
    mask = tree_mask(trees)
    assert mask[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert torch.equal(mask[1, :3, :3], torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    assert not mask[1, 3:].any() and not mask[1, :, 3:].any()
    assert verify_positions(trees, torch.tensor([10, 4]))[0].tolist() == [10, 11, 11, 12, 13, 12]
    ids, pos = flatten_verify_inputs(trees, torch.tensor([10, 4]))
    assert ids.tolist() == [9, 1, 2, 3, 4, 5, 7, 6, 5] and pos.tolist() == [10, 11, 11, 12, 13, 12, 4, 5, 6]


def test_chains_match_from_drafts() -> None:
    a = DraftTrees.chains(torch.tensor([[7, 6, 5, 0]]), [3])
    b = DraftTrees.from_drafts([CHAIN], 4)
    assert a.is_chain and b.is_chain
    assert torch.equal(a.ancestors(), b.ancestors()) and torch.equal(a.depths(), b.depths())


def test_custom_mask_layout() -> None:
    flat = custom_mask(_trees(), [2, 1])
    assert flat.numel() == 6 * (2 + 6) + 3 * (1 + 3)
    first = flat[:48].view(6, 8)
    assert first[:, :2].all() and torch.equal(first[:, 2:], tree_mask(_trees())[0])
    second = flat[48:].view(3, 4)
    assert second[:, 0].all() and torch.equal(second[:, 1:], torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_bad_parents_are_refused() -> None:
    with pytest.raises(ValueError, match="parent"):
        DraftTrees.from_drafts([(np.array([1, 2, 3]), np.array([-1, 2, 0]))], 3)
    with pytest.raises(ValueError, match="nodes"):
        DraftTrees.from_drafts([(np.array([1, 2, 3]), np.array([-1, 0, 1]))], 2)


def test_accepted_kv_moves() -> None:
    trees = _trees()
    slots = torch.tensor([[100, 101, 102, 103, 104, 105], [200, 201, 202, -1, -1, -1]])
    path = torch.tensor([[0, 1, 3, -1, -1, -1], [0, 1, -1, -1, -1, -1]])  # tree: root, 1, 3 accepted
    src, dst, free = accepted_kv_moves(trees, slots, path, torch.tensor([2, 1]))
    assert src.tolist() == [103] and dst.tolist() == [102]
    assert sorted(free.tolist()) == [103, 104, 105, 202]


def _toy_attention(q, k, v, visible):
    scores = (q @ k.T) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_tree_verify_attention_equals_each_path_alone() -> None:
    """A toy layer (keys and values from token and position embeddings): attending under the tree
    mask over prefix + nodes gives every node the output it gets when its path runs as a chain."""
    gen = torch.Generator().manual_seed(0)
    dim, vocab, prefix_len = 16, 12, 5
    tok_emb, pos_emb = torch.randn(vocab, dim, generator=gen), torch.randn(32, dim, generator=gen)
    wq, wk, wv = (torch.randn(dim, dim, generator=gen) for _ in range(3))
    prefix = torch.randint(0, vocab, (prefix_len,), generator=gen)
    trees = DraftTrees.from_drafts([TREE], 6)
    positions = verify_positions(trees, torch.tensor([prefix_len]))[0]

    def hidden(tokens, pos):
        return tok_emb[tokens] + pos_emb[pos]

    h_prefix = hidden(prefix, torch.arange(prefix_len))
    h_nodes = hidden(trees.tokens[0], positions)
    keys = torch.cat([h_prefix, h_nodes]) @ wk
    values = torch.cat([h_prefix, h_nodes]) @ wv
    visible = torch.cat([torch.ones(6, prefix_len, dtype=torch.bool), tree_mask(trees)[0]], dim=1)
    out = _toy_attention(h_nodes @ wq, keys, values, visible)
    for node in range(6):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = int(trees.parents[0, j]) if j > 0 else -1
        path.reverse()
        seq = torch.cat([prefix, trees.tokens[0, path]])
        h = hidden(seq, torch.arange(len(seq)))
        causal = torch.tril(torch.ones(len(seq), len(seq), dtype=torch.bool))
        alone = _toy_attention(h @ wq, h @ wk, h @ wv, causal)[-1]
        assert torch.allclose(out[node], alone, atol=1e-5), f"node {node}"
