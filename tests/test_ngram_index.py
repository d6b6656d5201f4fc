"""NGRAM drafting: suffix matches (longest, then most recent; window bounds), chain and tree
drafts (node budget, distinct siblings, breadth, branch length), the shared index's bound."""

from __future__ import annotations

import numpy as np
import pytest

from radixengine.speculative.ngram_index import (
    MAX_CANDIDATES,
    NgramIndex,
    NgramParams,
    PeerCorpus,
    SharedNgramIndex,
    suffix_matches,
)


def _brute_matches(ctx: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """(end, length) of every earlier occurrence with a following token, best first."""
    n = len(ctx)
    found = []
    for end in range(n - 1):
        length = 0
        while length < min(hi, n - 1) and end - length >= 0 and ctx[end - length] == ctx[n - 1 - length]:
            length += 1
        if length >= lo:
            found.append((end, length))
    return sorted(found, key=lambda m: (-m[1], -m[0]))


@pytest.mark.parametrize("seed", range(20))
def test_suffix_matches_equal_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 4, size=int(rng.integers(2, 120))).astype(np.int32)
    lo, hi = int(rng.integers(1, 3)), int(rng.integers(3, 9))
    params = NgramParams(min_match_window_size=lo, max_match_window_size=hi)
    ends, lengths = suffix_matches(ctx, params, limit=1000)
    want = _brute_matches(ctx.tolist(), lo, hi)
    assert list(zip(ends.tolist(), lengths.tolist())) == want


@pytest.mark.parametrize("seed", range(12))
def test_peer_corpus_finds_the_best_match_in_the_other_requests_tokens(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = [
        rng.integers(0, 3, size=int(rng.integers(1, 60))).astype(np.int32)
        for _ in range(int(rng.integers(1, 5)))
    ]
    i = int(rng.integers(0, len(batch)))
    ctx = batch[i]
    params = NgramParams(num_draft_tokens=5, max_match_window_size=6)
    # the brute force, peer by peer, on the peer's tokens followed by the context: the longest
    # match ending in a peer before its last token, then the latest in batch order
    window = min(6, len(ctx) - 1)
    want = []
    for j, peer in enumerate(batch):
        joined = np.concatenate([peer, [-7], ctx]).tolist()
        if j != i and window >= 1:
            want += [(n, j, e) for e, n in _brute_matches(joined, 1, window) if e < len(peer) - 1]
    got = PeerCorpus(batch).of(i).match(ctx, params)
    if not want:
        assert got is None
        return
    length, j, end = max(want)
    assert got is not None and got[0] == length
    assert got[1].tolist() == batch[j][end + 1 : end + 1 + params.continuation_length].tolist()


def test_a_request_drafts_from_a_peer_that_wrote_the_same_text_ahead() -> None:
    params = NgramParams(num_draft_tokens=5)
    ahead = np.array([50, 51, 52, 53, 54, 55, 56, 57], np.int32)
    mine = [9, 8, 50, 51, 52]
    index = NgramIndex(params, mine)
    assert index.draft().num_nodes == 1  # nothing of its own
    assert index.draft([PeerCorpus([np.array(mine, np.int32), ahead]).of(0)]).tokens.tolist() == [
        52,
        53,
        54,
        55,
        56,
    ]
    # a tie of length: its own match first
    mine = [60, 52, 70, 71, 72, 60, 52]
    own = NgramIndex(params, mine)
    peer = PeerCorpus([np.array(mine, np.int32), np.array([60, 52, 80, 81], np.int32)]).of(0)
    assert own.draft([peer]).tokens.tolist() == [52, 70, 71, 72, 60]
    # a longer match in the peer wins; a continuation stops at the end of the peer's tokens
    peer = PeerCorpus(
        [np.array(mine, np.int32), np.array([72, 60, 52, 80, 81], np.int32), np.array([5], np.int32)]
    )
    assert own.draft([peer.of(0)]).tokens.tolist() == [52, 80, 81]


def test_chain_draft_copies_what_followed_the_longest_match() -> None:
    # "7 1 2 3" recurs: the longest match of the suffix "9 1 2" ends at position 3.
    ctx = [5, 9, 1, 2, 8, 8, 7, 1, 2, 3, 4, 9, 1, 2]
    draft = NgramIndex(NgramParams(num_draft_tokens=4), ctx).draft()
    assert draft.tokens.tolist() == [2, 8, 8, 7] and draft.is_chain()
    # most recent among equally long matches: "1 2" ends at 3, 8 and 13; 8 is the latest earlier one
    draft = NgramIndex(NgramParams(num_draft_tokens=3, max_match_window_size=2), ctx).draft()
    assert draft.tokens.tolist() == [2, 3, 4]


def test_windows_bound_the_match() -> None:
    ctx = [1, 2, 3, 9, 3]
    assert NgramIndex(NgramParams(min_match_window_size=2), ctx).draft().num_nodes == 1  # only "3" recurs
    assert NgramIndex(NgramParams(min_match_window_size=1), ctx).draft().tokens.tolist() == [3, 9, 3]
    ends, lengths = suffix_matches(
        np.array([4, 4, 4, 4, 4, 4], np.int32), NgramParams(max_match_window_size=3), 10
    )
    assert lengths.max() == 3 and ends.tolist()[0] == 4


def test_no_match_and_growth() -> None:
    index = NgramIndex(NgramParams(), [1, 2, 3])
    draft = index.draft()
    assert draft.tokens.tolist() == [3] and draft.parents.tolist() == [-1]
    index.append(list(range(200)) + [1, 2])
    assert len(index) == 205 and index.tokens[-3:].tolist() == [199, 1, 2]
    assert index.draft().tokens.tolist()[:3] == [2, 3, 4]  # "1 2" last seen in 0 1 2 3 4


def test_draft_stops_at_the_end_of_the_context() -> None:
    # the continuation of the only match runs into the suffix itself
    draft = NgramIndex(NgramParams(num_draft_tokens=8), [1, 2, 1, 2]).draft()
    assert draft.tokens.tolist() == [2, 1, 2]


def _check_tree(tokens: np.ndarray, parents: np.ndarray, params: NgramParams) -> None:
    n = len(tokens)
    assert 1 <= n <= params.num_draft_tokens and parents[0] == -1
    assert all(0 <= parents[j] < j for j in range(1, n))
    siblings = {(int(parents[j]), int(tokens[j])) for j in range(1, n)}
    assert len(siblings) == n - 1, "repeated sibling"
    depth = [0] * n
    for j in range(1, n):
        depth[j] = depth[parents[j]] + 1
    assert max(depth) <= params.branch_length
    for node in range(n):
        children = int((parents == node).sum())
        assert children <= params.breadth(depth[node])


@pytest.mark.parametrize("seed", range(20))
def test_tree_drafts_are_well_formed(seed: int) -> None:
    rng = np.random.default_rng(seed)
    params = NgramParams(
        num_draft_tokens=int(rng.integers(2, 16)),
        max_bfs_breadth=int(rng.integers(1, 5)),
        max_branch_length=int(rng.integers(1, 8)),
    )
    ctx = rng.integers(0, 5, size=300)
    draft = NgramIndex(params, ctx).draft()
    _check_tree(draft.tokens, draft.parents, params)
    # every branch is a continuation of some match of the suffix
    text = ctx.tolist()
    for leaf in range(1, draft.num_nodes):
        path, node = [], leaf
        while node > 0:
            path.append(int(draft.tokens[node]))
            node = int(draft.parents[node])
        path.reverse()
        assert any(
            text[e + 1 : e + 1 + len(path)] == path for e in range(len(text) - 1) if text[e] == text[-1]
        )


def test_tree_uses_several_candidates() -> None:
    ctx = [1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 2, 7, 0, 1, 2]
    params = NgramParams(num_draft_tokens=7, max_bfs_breadth=3, max_branch_length=2)
    draft = NgramIndex(params, ctx).draft()
    # "0 1 2" is followed by 5 6 and 7 0; "1 2" (shorter) by 3 4
    assert draft.tokens.tolist() == [2, 7, 0, 5, 6, 3, 4]
    assert draft.parents.tolist() == [-1, 0, 1, 0, 3, 0, 5]
    chain = NgramIndex(NgramParams(num_draft_tokens=7, max_branch_length=2), ctx).draft()
    assert chain.is_chain() and chain.tokens.tolist() == [2, 7, 0]


def test_candidates_are_bounded() -> None:
    ctx = np.zeros(5 * MAX_CANDIDATES, dtype=np.int32)
    ends, _ = suffix_matches(ctx, NgramParams(), limit=10_000)
    assert len(ends) == MAX_CANDIDATES


def test_params_are_checked() -> None:
    with pytest.raises(ValueError):
        NgramParams(num_draft_tokens=1)
    with pytest.raises(ValueError):
        NgramParams(min_match_window_size=4, max_match_window_size=3)
    with pytest.raises(ValueError):
        NgramParams(min_bfs_breadth=3, max_bfs_breadth=2)


def test_shared_index_drafts_from_other_requests() -> None:
    shared = SharedNgramIndex(capacity=64)
    shared.insert([10, 11, 12, 13, 14, 15])
    index = NgramIndex(NgramParams(num_draft_tokens=4), [3, 11, 12])
    assert index.draft().num_nodes == 1
    assert index.draft([shared]).tokens.tolist() == [12, 13, 14, 15]
    # the request's own match of the same length ranks first
    own = NgramIndex(NgramParams(num_draft_tokens=3), [11, 12, 20, 21, 11, 12])
    assert own.draft([shared]).tokens.tolist() == [12, 20, 21]
    # a match never crosses into the next request
    shared.insert([40, 41])
    assert NgramIndex(NgramParams(num_draft_tokens=6), [1, 14, 15]).draft([shared]).num_nodes == 1


def test_shared_index_is_bounded() -> None:
    shared = SharedNgramIndex(capacity=50, key_len=2)
    rng = np.random.default_rng(0)
    for _ in range(200):
        shared.insert(rng.integers(0, 1000, size=int(rng.integers(1, 30))))
        assert len(shared) <= 50 and shared.table_size <= 100 + 30
    old = [7001, 7002, 7003, 7004]
    shared.insert(old)
    for _ in range(10):
        shared.insert(rng.integers(0, 1000, size=20))
    # overwritten by the ring: never matched, even though its hash may still be in the table
    assert shared.match(np.array([5, 7001, 7002]), NgramParams()) is None
    shared.insert(old)
    length, cont = shared.match(np.array([5, 7001, 7002]), NgramParams())
    assert length == 2 and cont.tolist() == [7003, 7004]


def test_a_draft_after_a_step_in_flight_is_one_node_longer() -> None:
    # the first node predicts the bonus of the step in flight; the next num_draft_tokens - 1 are drafts
    ctx = [5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 5]
    index = NgramIndex(NgramParams(num_draft_tokens=4), ctx)
    assert index.draft().tokens.tolist() == [5, 1, 2, 3]
    assert index.draft_after([1]).tokens.tolist() == [1, 2, 3, 4, 6]
    assert len(index) == len(ctx)
