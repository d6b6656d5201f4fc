"""Shared prefixes of a decode batch, found from the KV slots of its requests.

Requests that hit the same radix-cache prefix hold the same KV slots for it: their
`req_to_token` rows start alike. Sorting the rows lexicographically puts requests with a common
prefix next to each other, and the common-prefix lengths of neighbours give the prefix tree of the
batch (the LCP intervals of the sorted rows): a system prompt shared by all, a few-shot block by
some of them, a user's history by a few. Each node of that tree long enough to pay is a *unit*:
positions [start, end) of one row, shared by its members, computed once for all of them by the
cascade kernel; a node too short to pay is folded into the nodes below it. What lies past a
request's deepest unit is its own part.

Every part of a request leaves a partial result in a *slot* of that request, merged later by its
log-sum-exp: the units take slots 0, 1, ... in order, the own part the slots from `own_slot`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# A node shorter than this many tokens is not worth its own pass (its tokens go to the nodes
# below it); `--shared-prefix-attention-min-len` sets it.
DEFAULT_MIN_SHARED_LEN = 64
# A unit is one task of the kernel. One that would hold more than a thread's share of the step's
# work is cut into pieces of whole key blocks (but the last), so that the threads finish
# together; each piece costs one more partial to merge and its own pass setup, so nothing is cut
# that need not be. The estimate of the work: a unit's keys x members, plus each request's own
# keys (and a fixed cost per request) at OWN_KEY_COST each: read per request rather than once for
# a matrix of queries, an own key costs the kernels about nine times a unit's key-member
# (bench_shared_prefix_attention's W1 shape on AMX and AVX-512).
KEY_BLOCK = 64
OWN_KEY_COST = 9
OWN_TASK_KEYS = 8
# Most members of one unit (their query heads are the rows of the unit's matrix products).
MAX_UNIT_MEMBERS = 32


@dataclass(frozen=True)
class CascadePlan:
    """Tensors in the layout of `native_cpu_ops.decode_attention_cascade` (int64, on the CPU)."""

    unit_rows: torch.Tensor  # [U] req_to_token row to read the unit's slots from
    unit_start: torch.Tensor  # [U] first position
    unit_end: torch.Tensor  # [U] one past the last position
    unit_member_ptr: torch.Tensor  # [U + 1] CSR offsets into unit_members
    unit_members: torch.Tensor  # [N] batch indices
    unit_member_slots: torch.Tensor  # [N] partial slot of each membership
    own_start: torch.Tensor  # [bs] first position of each request's own part
    own_slot: torch.Tensor  # [bs] first slot of each request's own part
    shared_tokens: int  # sum over units of positions x (members - 1): key reads saved

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.unit_rows,
            self.unit_start,
            self.unit_end,
            self.unit_member_ptr,
            self.unit_members,
            self.unit_member_slots,
            self.own_start,
            self.own_slot,
        )


@dataclass(frozen=True)
class _Node:
    depth: int  # common prefix length of its requests
    lo: int  # first and last index in the sorted order
    hi: int


def build_cascade_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: list[int],
    min_shared_len: int = DEFAULT_MIN_SHARED_LEN,
    num_threads: int = 1,
    max_unit_len: int | None = None,
    max_unit_members: int = MAX_UNIT_MEMBERS,
) -> CascadePlan | None:
    """The shared-prefix plan of a decode batch (`seq_lens` include each new token), or None when
    no prefix of at least `min_shared_len` positions is shared by two requests. Units are cut
    for `num_threads` threads (see OWN_KEY_COST) and to at most `max_unit_len` positions."""
    bs = len(seq_lens)
    if bs < 2:
        return None
    rows = req_pool_indices.to(device="cpu", dtype=torch.long)
    if not _may_share(req_to_token, rows, seq_lens, min_shared_len):
        return None
    table = req_to_token.index_select(0, rows.to(req_to_token.device)).cpu()
    order, lcp = _sorted_lcp(table[:, : max(seq_lens)].numpy(), seq_lens)
    units, own_start = _units(_lcp_nodes(lcp), bs, min_shared_len)
    if not units:
        return None
    lens = np.asarray(seq_lens)[order]
    share = _thread_share(units, lens - np.asarray(own_start), num_threads)
    return _pack(units, own_start, order, rows.tolist(), _Cuts(share, max_unit_len, max_unit_members))


def _may_share(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: list[int], min_len: int) -> bool:
    """Whether two requests may share a prefix of `min_len` positions: then they hold the same
    slot at position min_len - 1 (every unit ends at least that deep). One column's gather, so
    a batch with nothing (or too little) shared costs next to nothing."""
    longer = [n > min_len for n in seq_lens]
    if sum(longer) < 2:
        return False
    if min_len > req_to_token.shape[1]:
        return False
    column = req_to_token[rows.to(req_to_token.device), min_len - 1].tolist()
    slots = [slot for slot, long in zip(column, longer) if long]
    return len(set(slots)) < len(slots)


def _sorted_lcp(table: np.ndarray, seq_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The batch indices in lexicographic order of their rows, and lcp[i] = the common prefix
    length of sorted rows i - 1 and i (lcp[0] = 0). Positions past a request's length hold a
    value of its own, so they never match."""
    table = table.astype(np.int64)
    width = table.shape[1]
    past_end = np.arange(width)[None, :] >= np.asarray(seq_lens)[:, None]
    table[past_end] = -1 - np.nonzero(past_end)[0]
    # Rows as big-endian unsigned bytes (sign bit flipped) compare as their integers do, so one
    # sort of byte strings is the lexicographic order (np.lexsort would sort once per column).
    keys = (table.view(np.uint64) ^ np.uint64(1 << 63)).astype(">u8").tobytes()
    row_bytes = width * 8
    order = np.array(
        sorted(range(len(table)), key=lambda i: keys[i * row_bytes : (i + 1) * row_bytes]), dtype=np.int64
    )
    ordered = table[order]
    differs = ordered[1:] != ordered[:-1]
    lcp = np.where(differs.any(axis=1), differs.argmax(axis=1), width)
    # The last position of a request is its new token: never shared.
    lens = np.asarray(seq_lens)[order]
    lcp = np.minimum(lcp, np.minimum(lens[1:], lens[:-1]) - 1)
    return order, np.concatenate(([0], lcp))


def _lcp_nodes(lcp: np.ndarray) -> list[_Node]:
    """The internal nodes of the prefix tree of the sorted rows (depth > 0, two or more
    requests), parents before children."""
    nodes: list[_Node] = []
    stack: list[tuple[int, int]] = [(0, 0)]  # (depth, lo)
    n = len(lcp)
    for i in range(1, n + 1):
        h = int(lcp[i]) if i < n else 0
        lo = i - 1
        while stack[-1][0] > h:
            depth, lo = stack.pop()
            nodes.append(_Node(depth, lo, i - 1))
        if stack[-1][0] < h:
            stack.append((h, lo))
    nodes.sort(key=lambda node: (node.lo, -node.hi, node.depth))
    return nodes


def _units(nodes: list[_Node], bs: int, min_len: int) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """Kept nodes as (start, end, lo, hi) in sorted order, and each sorted request's own start.

    A node's part starts where its deepest kept ancestor ends; it is kept when that part has at
    least `min_len` positions."""
    units: list[tuple[int, int, int, int]] = []
    own_start = [0] * bs
    ancestors: list[tuple[int, int]] = []  # (hi, end) of the kept nodes enclosing the current one
    for node in nodes:
        while ancestors and ancestors[-1][0] < node.lo:
            ancestors.pop()
        base = ancestors[-1][1] if ancestors else 0
        if node.depth - base >= min_len:
            units.append((base, node.depth, node.lo, node.hi))
            ancestors.append((node.hi, node.depth))
            for i in range(node.lo, node.hi + 1):
                own_start[i] = node.depth
    return units, own_start


def _thread_share(units: list[tuple[int, int, int, int]], own_lens: np.ndarray, num_threads: int) -> float:
    """A thread's share of the step's estimated work (module comment)."""
    unit_work = sum((end - start) * (hi - lo + 1) for start, end, lo, hi in units)
    own_work = OWN_KEY_COST * int((own_lens + OWN_TASK_KEYS).sum())
    return (unit_work + own_work) / max(1, num_threads)


@dataclass(frozen=True)
class _Cuts:
    thread_share: float  # most estimated work of one unit task
    max_len: int | None  # most positions of one unit
    max_members: int

    def piece_len(self, length: int, members: int) -> int:
        """Positions per piece of a unit of `length` positions: whole key blocks, as few pieces
        as the share and max_len allow."""
        pieces = max(1, math.ceil(members * length / self.thread_share))
        if self.max_len is not None:
            pieces = max(pieces, -(-length // self.max_len))
        return -(-length // (pieces * KEY_BLOCK)) * KEY_BLOCK


def _pack(
    units: list[tuple[int, int, int, int]],
    own_start_sorted: list[int],
    order: np.ndarray,
    rows: list[int],
    cuts: _Cuts,
) -> CascadePlan:
    bs = len(order)
    next_slot = [0] * bs
    unit_rows, starts, ends, ptr, members, slots = [], [], [], [0], [], []
    shared = 0
    max_members = cuts.max_members
    for start, end, lo, hi in units:
        group = [int(b) for b in order[lo : hi + 1]]
        shared += (end - start) * (len(group) - 1)
        piece_len = cuts.piece_len(end - start, min(len(group), max_members))
        for piece_start in range(start, end, piece_len):
            piece_end = min(end, piece_start + piece_len)
            for first in range(0, len(group), max_members):
                block = group[first : first + max_members]
                unit_rows.append(rows[block[0]])
                starts.append(piece_start)
                ends.append(piece_end)
                members.extend(block)
                for b in block:
                    slots.append(next_slot[b])
                    next_slot[b] += 1
                ptr.append(len(members))
    own_start = [0] * bs
    for i, b in enumerate(order):
        own_start[int(b)] = own_start_sorted[i]

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    return CascadePlan(
        t(unit_rows), t(starts), t(ends), t(ptr), t(members), t(slots), t(own_start), t(next_slot), shared
    )
