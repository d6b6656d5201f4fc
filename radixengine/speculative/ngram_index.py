"""NGRAM drafting: proposals copied from what followed earlier occurrences of the context's suffix.

`NgramIndex` is one request's index: its prompt and generated tokens in a growing int32 buffer.
A draft looks for the longest suffix of the context (between `min_match_window_size` and
`max_match_window_size` tokens) that occurred before, vectorised over the buffer (one compare
over the context for the candidates ending with the last token, one gather for their match
lengths), and proposes the tokens that followed. Candidates rank by match length, then recency.

The draft is a tree rooted at the request's last token (node 0): the best candidate's continuation
is its main branch (at most `max_branch_length` tokens), the next candidates add their diverging
continuations while the node budget (`num_draft_tokens - 1`) lasts, a node having at most
`max_bfs_breadth` children at the root, falling linearly to `min_bfs_breadth` at the deepest level
(SGLang's knobs). With `max_bfs_breadth` 1 the draft is a chain. Siblings are always distinct.

The other requests running beside it are searched too (`peer_match`, the same vectorised match
over their tokens): requests writing the same text draft from the one ahead. `SharedNgramIndex`
(optional, `capacity` > 0) holds the tokens of recent requests in a ring of
`capacity` tokens, found by the hash of their k-grams; its latest match ranks after the request's
own candidates of the same length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Most recent occurrences of the last token that are checked for a longer match.
MAX_CANDIDATES = 256
_SEPARATOR = -1


@dataclass(frozen=True)
class NgramParams:
    """SGLang's `--speculative-num-draft-tokens` and `--speculative-ngram-*` knobs."""

    num_draft_tokens: int = 8  # tokens verified per step, the root (last token) included
    min_match_window_size: int = 1
    max_match_window_size: int = 12
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 1
    max_branch_length: int = 16  # longest branch of the draft tree
    capacity: int = 0  # tokens of the shared index of recent requests (0: none)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 2:
            raise ValueError(
                f"num_draft_tokens must be >= 2 (the root and a draft), got {self.num_draft_tokens}"
            )
        if not 1 <= self.min_match_window_size <= self.max_match_window_size:
            raise ValueError(
                "need 1 <= min_match_window_size <= max_match_window_size, got "
                f"{self.min_match_window_size} and {self.max_match_window_size}"
            )
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError(
                f"need 1 <= min_bfs_breadth <= max_bfs_breadth, got {self.min_bfs_breadth} and {self.max_bfs_breadth}"
            )
        if self.max_branch_length < 1 or self.capacity < 0:
            raise ValueError("max_branch_length must be >= 1 and capacity >= 0")

    @property
    def branch_length(self) -> int:
        return min(self.max_branch_length, self.num_draft_tokens - 1)

    def breadth(self, depth: int) -> int:
        """Children a node at `depth` (root 0) may have."""
        deepest = max(self.branch_length - 1, 1)
        span = self.max_bfs_breadth - self.min_bfs_breadth
        return max(self.min_bfs_breadth, round(self.max_bfs_breadth - span * depth / deepest))


@dataclass
class NgramDraft:
    """A draft tree: node 0 is the root (the request's last token, already sampled), every other
    node a proposed token whose parent comes before it."""

    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int64 [n]; -1 for the root

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, self.num_nodes - 1)))


@dataclass
class Match:
    """Candidate continuations, best first: `continuations[i]` followed a suffix of
    `lengths[i]` tokens."""

    lengths: list[int]
    continuations: list[np.ndarray]


class NgramIndex:
    """One request's tokens (prompt, then output), appended as they are accepted."""

    def __init__(self, params: NgramParams, tokens: Sequence[int] = ()) -> None:
        self.params = params
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int32)
        self._len = 0
        self.append(tokens)

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._len]

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        n = len(tokens)
        if self._len + n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self._len + n), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + n] = tokens
        self._len += n

    def match(self, limit: int = MAX_CANDIDATES) -> Match:
        """Earlier occurrences of the context's suffix, best first (longest match, then most
        recent), each with the tokens that followed it (at most `branch_length`)."""
        ends, lengths = suffix_matches(self.tokens, self.params, limit)
        depth = self.params.branch_length
        ctx = self.tokens
        conts = [ctx[e + 1 : e + 1 + depth].astype(np.int64) for e in ends.tolist()]
        return Match(lengths.tolist(), conts)

    def draft(self, shared: SharedNgramIndex | None = None, peers: Sequence[np.ndarray] = ()) -> NgramDraft:
        """The draft tree for the next verify step (only the root when nothing matches). `peers`:
        the tokens of the other requests running beside this one, searched as well (a match
        there ranks after the request's own matches of the same length)."""
        if self._len == 0:
            raise ValueError("an empty context has no last token to draft from")
        limit = 1 if self.params.max_bfs_breadth == 1 else 4 * self.params.max_bfs_breadth
        found = self.match(limit)
        if shared is not None:
            _merge_shared(found, shared.match(self.tokens, self.params))
        for peer in peers:
            _merge_shared(found, peer_match(self.tokens, peer, self.params))
        return build_draft_tree(int(self.tokens[-1]), found, self.params)

    def draft_after(
        self, extra: Sequence[int], shared: SharedNgramIndex | None = None, peers: Sequence[np.ndarray] = ()
    ) -> NgramDraft:
        """The draft as if `extra` followed the context (tokens not accepted yet); the index is
        left as it was."""
        length = self._len
        self.append(extra)
        try:
            return self.draft(shared, peers)
        finally:
            self._len = length


def suffix_matches(
    ctx: np.ndarray, params: NgramParams, limit: int, corpus: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(end positions in `corpus`, match lengths) of occurrences of the context's suffix with at
    least one token after them, best first; at most `limit`, from the `MAX_CANDIDATES` most
    recent. `corpus` defaults to the context itself (its earlier occurrences)."""
    corpus = ctx if corpus is None else corpus
    n = len(ctx)
    window = min(params.max_match_window_size, n - 1)
    if window < params.min_match_window_size:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    ends = np.flatnonzero(corpus[: len(corpus) - 1] == ctx[n - 1])[-MAX_CANDIDATES:]
    if len(ends) == 0:
        return ends, ends
    offsets = np.arange(window)
    idx = ends[:, None] - offsets[None, :]
    same = (corpus[np.maximum(idx, 0)] == ctx[n - 1 - offsets][None, :]) & (idx >= 0)
    lengths = np.where(same.all(axis=1), window, same.argmin(axis=1))
    keep = lengths >= params.min_match_window_size
    ends, lengths = ends[keep], lengths[keep]
    order = np.lexsort((-ends, -lengths))[:limit]
    return ends[order], lengths[order]


def peer_match(ctx: np.ndarray, peer: np.ndarray, params: NgramParams) -> tuple[int, np.ndarray] | None:
    """(match length, continuation) of the best occurrence of the context's suffix in another
    request's tokens `peer` (the longest, then the latest), or None."""
    ends, lengths = suffix_matches(ctx, params, 1, corpus=peer)
    if len(ends) == 0:
        return None
    end = int(ends[0])
    return int(lengths[0]), peer[end + 1 : end + 1 + params.branch_length].astype(np.int64)


def build_draft_tree(root_token: int, found: Match, params: NgramParams) -> NgramDraft:
    """Insert the candidates' continuations, best first, into a tree of at most
    `num_draft_tokens` nodes (root included) with distinct siblings."""
    tokens, parents, depths = [root_token], [-1], [0]
    children: dict[tuple[int, int], int] = {}
    num_children = [0]
    budget = params.num_draft_tokens
    for cont in found.continuations:
        node = 0
        for token in cont.tolist():
            if len(tokens) >= budget:
                break
            child = children.get((node, token))
            if child is None:
                if num_children[node] >= params.breadth(depths[node]):
                    break
                child = len(tokens)
                children[(node, token)] = child
                tokens.append(token)
                parents.append(node)
                depths.append(depths[node] + 1)
                num_children[node] += 1
                num_children.append(0)
            node = child
        if len(tokens) >= budget:
            break
    return NgramDraft(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64))


def _merge_shared(found: Match, shared: tuple[int, np.ndarray] | None) -> None:
    """Rank a candidate from elsewhere (the shared index, a peer) after the candidates already
    found of the same length."""
    if shared is None:
        return
    length, cont = shared
    at = next((i for i, n in enumerate(found.lengths) if n < length), len(found.lengths))
    found.lengths.insert(at, length)
    found.continuations.insert(at, cont)


class SharedNgramIndex:
    """Recent requests' tokens in a ring of `capacity` tokens (requests separated), and a table
    from the hash of every `key_len`-gram to the end of its latest occurrence. Bounded: a
    position the ring has overwritten is stale and ignored, and the table is rebuilt from the
    ring when it outgrows twice the capacity."""

    def __init__(self, capacity: int, key_len: int = 2) -> None:
        if capacity < 2 * key_len:
            raise ValueError(f"capacity {capacity} is too small for {key_len}-grams")
        self.capacity, self.key_len = capacity, key_len
        self._ring = np.full(capacity, _SEPARATOR, dtype=np.int64)
        self._head = 0  # absolute position of the next token written
        self._table: dict[int, int] = {}

    def __len__(self) -> int:
        return min(self._head, self.capacity)

    @property
    def table_size(self) -> int:
        return len(self._table)

    def insert(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Add one request's tokens (only the last `capacity - 1` are kept)."""
        seq = np.asarray(tokens, dtype=np.int64)[-(self.capacity - 1) :]
        seq = np.append(seq, _SEPARATOR)
        start = self._head
        self._ring[(start + np.arange(len(seq))) % self.capacity] = seq
        self._head += len(seq)
        if len(seq) > self.key_len:
            keys = _kgram_hashes(seq[:-1], self.key_len)
            ends = start + self.key_len - 1 + np.arange(len(keys))
            self._table.update(zip(keys.tolist(), ends.tolist()))
        if len(self._table) > 2 * self.capacity:
            self._rebuild()

    def match(self, ctx: np.ndarray, params: NgramParams) -> tuple[int, np.ndarray] | None:
        """(match length, continuation) from the latest occurrence of the context's last
        `key_len` tokens, or None."""
        k = self.key_len
        if len(ctx) < max(k, params.min_match_window_size):
            return None
        tail = np.asarray(ctx[-k:], dtype=np.int64)
        end = self._table.get(int(_kgram_hashes(tail, k)[0]))
        if end is None or end < self._head - self.capacity + params.max_match_window_size:
            return None
        window = min(params.max_match_window_size, len(ctx), end + 1)
        seen = self._ring[(end - np.arange(window)) % self.capacity]
        same = seen == np.asarray(ctx[::-1][:window], dtype=np.int64)
        length = window if same.all() else int(same.argmin())
        if length < max(k, params.min_match_window_size):
            return None
        stop = min(end + 1 + params.branch_length, self._head)
        cont = self._ring[np.arange(end + 1, stop) % self.capacity]
        cut = np.flatnonzero(cont == _SEPARATOR)
        cont = cont[: cut[0]] if len(cut) else cont
        return (length, cont) if len(cont) else None

    def _rebuild(self) -> None:
        start = max(self._head - self.capacity, 0)
        seq = self._ring[np.arange(start, self._head) % self.capacity]
        keys = _kgram_hashes(seq, self.key_len)
        ends = start + self.key_len - 1 + np.arange(len(keys))
        valid = ~np.lib.stride_tricks.sliding_window_view(seq == _SEPARATOR, self.key_len).any(axis=1)
        self._table = dict(zip(keys[valid].tolist(), ends[valid].tolist()))


_HASH_MULTS = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5], dtype=np.uint64
)


def _kgram_hashes(seq: np.ndarray, k: int) -> np.ndarray:
    """A 64-bit hash of every k-gram of `seq` (k <= 4), as int64; collisions are checked by the
    caller against the tokens."""
    if k > len(_HASH_MULTS):
        raise ValueError(f"key_len must be <= {len(_HASH_MULTS)}")
    windows = np.lib.stride_tricks.sliding_window_view(seq.astype(np.uint64), k)
    h = np.zeros(len(windows), dtype=np.uint64)
    for j in range(k):
        h = (h ^ (windows[:, j] + np.uint64(j))) * _HASH_MULTS[j]
    return h.view(np.int64)
