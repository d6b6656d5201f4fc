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

The other requests running beside it are searched too (`PeerCorpus`: the batch's tokens end to
end, one vectorised match over all the others' tokens): requests writing the same text draft from
the one ahead. `SharedNgramIndex`
(optional, `capacity` > 0) holds the tokens of recent requests in a ring of
`capacity` tokens, found by the hash of their k-grams; its latest match ranks after the request's
own candidates of the same length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Most recent occurrences of the last token that are checked for a longer match (in the request's
# own tokens; in the batch's, which hold several requests, four times as many).
MAX_CANDIDATES = 256
MAX_PEER_CANDIDATES = 4 * MAX_CANDIDATES
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

    @property
    def continuation_length(self) -> int:
        """Tokens a candidate continues with: a branch, and one more for a draft after a step in
        flight (whose first node predicts that step's bonus)."""
        return min(self.max_branch_length, self.num_draft_tokens)

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
        recent), each with the tokens that followed it (at most `continuation_length`)."""
        ends, lengths = suffix_matches(self.tokens, self.params, limit)
        depth = self.params.continuation_length
        ctx = self.tokens
        conts = [ctx[e + 1 : e + 1 + depth].astype(np.int64) for e in ends.tolist()]
        return Match(lengths.tolist(), conts)

    def draft(self, sources: Sequence[CandidateSource] = ()) -> NgramDraft:
        """The draft tree for the next verify step (only the root when nothing matches).
        `sources`: tokens other than the request's own, searched as well (the shared index of
        recent requests, the batch's other requests); a match there ranks after the request's
        own matches of the same length."""
        return self._draft(sources, self.params.num_draft_tokens)

    def draft_after(self, extra: Sequence[int], sources: Sequence[CandidateSource] = ()) -> NgramDraft:
        """The draft as if `extra` followed the context (tokens not accepted yet), one node
        longer: its first node predicts the bonus of the step `extra` is in, the rest are the
        next step's `num_draft_tokens - 1` drafts. The index is left as it was."""
        length = self._len
        self.append(extra)
        try:
            return self._draft(sources, self.params.num_draft_tokens + 1)
        finally:
            self._len = length

    def _draft(self, sources: Sequence[CandidateSource], num_nodes: int) -> NgramDraft:
        if self._len == 0:
            raise ValueError("an empty context has no last token to draft from")
        limit = 1 if self.params.max_bfs_breadth == 1 else 4 * self.params.max_bfs_breadth
        found = self.match(limit)
        for source in sources:
            _merge_shared(found, source.match(self.tokens, self.params))
        return build_draft_tree(int(self.tokens[-1]), found, self.params, num_nodes)


class CandidateSource(Protocol):
    """Tokens beside a request's own that it drafts from: the best (match length, continuation)
    for a context, or None."""

    def match(self, ctx: np.ndarray, params: NgramParams) -> tuple[int, np.ndarray] | None: ...


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
    lengths = _match_lengths(ctx, corpus, ends, window)
    keep = lengths >= params.min_match_window_size
    ends, lengths = ends[keep], lengths[keep]
    order = np.lexsort((-ends, -lengths))[:limit]
    return ends[order], lengths[order]


def _match_lengths(ctx: np.ndarray, corpus: np.ndarray, ends: np.ndarray, window: int) -> np.ndarray:
    """How many of the context's last tokens (at most `window`) equal those of `corpus` ending at
    each of `ends` (whose token equals the context's last)."""
    if len(ends) == 0:
        return ends
    offsets = np.arange(window)
    idx = ends[:, None] - offsets[None, :]
    same = (corpus[np.maximum(idx, 0)] == ctx[len(ctx) - 1 - offsets][None, :]) & (idx >= 0)
    return np.where(same.all(axis=1), window, same.argmin(axis=1))


class PeerCorpus:
    """The tokens of the requests of a batch end to end, each followed by a separator, so that a
    request's best match in all the others' tokens is one vectorised search (`of(i)`)."""

    def __init__(self, token_arrays: Sequence[np.ndarray]) -> None:
        sizes = [len(t) + 1 for t in token_arrays]
        self.bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.tokens = np.full(int(self.bounds[-1]), _SEPARATOR, dtype=np.int32)
        for start, tokens in zip(self.bounds[:-1].tolist(), token_arrays):
            self.tokens[start : start + len(tokens)] = tokens

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def of(self, i: int) -> PeerView:
        """Request `i`'s view: every request's tokens but its own."""
        return PeerView(self, i)

    def best_match(self, ctx: np.ndarray, params: NgramParams, skip: int) -> tuple[int, np.ndarray] | None:
        """(match length, continuation) of the best occurrence of the context's suffix outside
        request `skip`'s tokens (the longest, then the latest in batch order), or None."""
        window = min(params.max_match_window_size, len(ctx) - 1)
        if window < params.min_match_window_size:
            return None
        corpus = self.tokens
        ends = np.flatnonzero(corpus == ctx[-1])
        lo, hi = self.bounds[skip], self.bounds[skip + 1]
        # the last token of a request has no continuation: the separator follows it
        ends = ends[((ends < lo) | (ends >= hi)) & (corpus[ends + 1] != _SEPARATOR)][-MAX_PEER_CANDIDATES:]
        lengths = _match_lengths(ctx, corpus, ends, window)
        if len(ends) == 0 or lengths.max() < params.min_match_window_size:
            return None
        best = len(lengths) - 1 - int(np.argmax(lengths[::-1]))  # the latest of the longest
        end = int(ends[best])
        cont = corpus[end + 1 : end + 1 + params.continuation_length]
        cut = np.flatnonzero(cont == _SEPARATOR)
        cont = cont[: cut[0]] if len(cut) else cont
        return int(lengths[best]), cont.astype(np.int64)


@dataclass(frozen=True)
class PeerView:
    """A request's `CandidateSource` of the other requests of its batch."""

    corpus: PeerCorpus
    index: int

    def match(self, ctx: np.ndarray, params: NgramParams) -> tuple[int, np.ndarray] | None:
        return self.corpus.best_match(ctx, params, self.index)


def build_draft_tree(
    root_token: int, found: Match, params: NgramParams, num_nodes: int | None = None
) -> NgramDraft:
    """Insert the candidates' continuations, best first, into a tree of at most `num_nodes`
    (default `num_draft_tokens`) nodes, root included, with distinct siblings."""
    tokens, parents, depths = [root_token], [-1], [0]
    children: dict[tuple[int, int], int] = {}
    num_children = [0]
    budget = params.num_draft_tokens if num_nodes is None else num_nodes
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


SHARED_KEY_LEN = 2  # the shared index finds matches by the hash of this many tokens
MIN_SHARED_CAPACITY = 2 * SHARED_KEY_LEN


class SharedNgramIndex:
    """Recent requests' tokens in a ring of `capacity` tokens (requests separated), and a table
    from the hash of every `key_len`-gram to the end of its latest occurrence. Bounded: a
    position the ring has overwritten is stale and ignored, and the table is rebuilt from the
    ring when it outgrows twice the capacity."""

    def __init__(self, capacity: int, key_len: int = SHARED_KEY_LEN) -> None:
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
        stop = min(end + 1 + params.continuation_length, self._head)
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
