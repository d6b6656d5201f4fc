"""Speculative decoding under the overlap loop: a verify step launched before the result of the
step before it is known (SGLang's spec v2), resolved on the forward stream.

When the scheduler builds verify step N+1, step N is still running: how many of its drafts it
accepts, its bonus token, and so the position of step N+1's first node are unknown on the host.
The scheduler therefore sends a `FutureVerify`:

- draft tokens made on the host from the request's known tokens plus the drafts of step N, as if
  step N accepted them all; `expected` is what step N must emit (its drafts and the predicted bonus)
  for these drafts to continue the request's text. A request with no step in flight has no
  expectation: its drafts follow its known tokens.
- a window of KV slots: the request's slots from its known KV length on, allocated for the worst
  case (step N accepting everything, then all of step N+1's nodes).

On the forward stream, after step N stored its results in the FutureMap (the last token, the KV
length, the emitted tokens), `resolve_future_verify` fills in the root (step N's bonus), the
prefix length, the node count (the drafts when step N emitted exactly `expected`, else none: a
plain decode step for that request), the slots (from the window at the resolved position) and the
sampling steps. Drafts never need to be right for the output to be exact: every node is verified
against the target, so a guessed draft only costs a wasted node."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from radixengine.speculative.spec_tree import DraftTrees

NO_EXPECTATION = -1  # `expected_len` of a request with no step in flight


@dataclass
class FutureVerify:
    drafts: torch.Tensor  # int64 [bs, n]: column 0 unused (the root comes from the FutureMap)
    num_nodes: torch.Tensor  # int64 [bs]: nodes when the drafts hold (1 + drafts)
    expected: torch.Tensor  # int64 [bs, e]: what the step in flight must emit, padded with -1
    expected_len: torch.Tensor  # int64 [bs]: NO_EXPECTATION when no step is in flight
    window: torch.Tensor  # int64 [bs, w]: the row's KV slots from position `window_start` on
    window_start: torch.Tensor  # int64 [bs]: the KV length known on the host
    steps_base: torch.Tensor  # int64 [bs]: output tokens known on the host
    # On the host: the row's expectation is one token, the bonus of its step in flight (that step
    # had no drafts, or its drafts did not hold), i.e. the first drafted token itself.
    expects_bonus_only: list[bool] = dataclasses.field(default_factory=list)


@dataclass
class FutureMapView:
    """The FutureMap's buffers, indexed by req_pool_idx + 1 (see managers/overlap_utils.py)."""

    token_ids: torch.Tensor  # int64 [rows + 1]: the last token of each row
    kv_lens: torch.Tensor  # int64 [rows + 1]: tokens with KV after the row's last step
    emitted: torch.Tensor  # int64 [rows + 1, width]: the tokens the row's last step emitted
    emitted_len: torch.Tensor  # int64 [rows + 1]


@dataclass
class ResolvedVerify:
    trees: DraftTrees
    prefix_lens: torch.Tensor  # int64 [bs]
    out_cache_loc: torch.Tensor  # int64 [sum(num_nodes)]
    steps: torch.Tensor  # int64 [bs]: output tokens before this step's root


def resolve_future_verify(fv: FutureVerify, rows: torch.Tensor, fm: FutureMapView) -> ResolvedVerify:
    """Run on the forward stream, after the previous step of these rows published."""
    idx = rows + 1
    prefix = fm.kv_lens[idx]
    in_flight = fv.expected_len != NO_EXPECTATION
    emitted, emitted_len = fm.emitted[idx], fm.emitted_len[idx]
    width = fv.expected.shape[1]
    same = (emitted[:, :width] == fv.expected) | (
        torch.arange(width, device=rows.device) >= fv.expected_len.view(-1, 1)
    )
    holds = ~in_flight | ((emitted_len == fv.expected_len) & same.all(dim=1))
    num_nodes = torch.where(holds, fv.num_nodes, torch.ones_like(fv.num_nodes))
    tokens = fv.drafts.clone()
    tokens[:, 0] = fm.token_ids[idx]
    trees = DraftTrees.chains(tokens, num_nodes.tolist())
    n = tokens.shape[1]
    offsets = (prefix - fv.window_start).view(-1, 1) + torch.arange(n, device=rows.device)
    slots = fv.window.gather(1, offsets.clamp(max=fv.window.shape[1] - 1))[trees.valid()]
    steps = fv.steps_base + torch.where(in_flight, emitted_len, torch.zeros_like(emitted_len))
    return ResolvedVerify(trees, prefix, slots, steps)
