"""The running batch's next step under the overlap loop with speculative decoding: built while the
step before it (N) still runs, so without its accepted lengths (speculative/spec_overlap.py).

- KV lengths on the host are upper bounds: a request's `kv_allocated_len` (its known KV length
  plus the nodes of its step in flight). Step N+1 allocates its nodes past that bound (the worst
  case: step N accepted everything); processing step N frees what step N+1 cannot reach.
- Drafts: each request's drafter continues its known tokens plus the drafts of its step in flight
  (as if all were accepted): the first proposed token predicts step N's bonus (`expected`), the
  rest are step N+1's drafts. The forward stream keeps them only if step N emitted `expected`.
- A batch that drafts nothing and whose steps in flight drafted nothing (so every KV length on
  the host is exact) runs a plain decode step; otherwise a verify step, a request without drafts
  verifying its root alone (its decode step)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from radixengine.managers.batch_slots import int64_tensor
from radixengine.managers.overlap_utils import StepTimer
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.scheduler_components.speculative_drafter import Drafter
from radixengine.mem_cache.base_prefix_cache import finished_kv_len
from radixengine.speculative.request_state import InflightStep
from radixengine.speculative.spec_overlap import NO_EXPECTATION, FutureVerify
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.utils.fault_injection import fault_point


def refresh_upper_lens(batch: ScheduleBatch) -> None:
    """The batch's KV lengths from its requests' allocations (upper bounds while a verify step of
    theirs is in flight): what the memory check and the next step's slots start from."""
    lens = [r.kv_allocated_len or s for r, s in zip(batch.reqs, batch.seq_lens_cpu.tolist())]
    batch.seq_lens_cpu = int64_tensor(lens)
    batch.seq_lens = batch.seq_lens_cpu.to(batch.device)


@dataclass
class _Plan:
    drafts: list[list[int]]
    expected: list[list[int] | None]
    exact: bool  # every request's KV length on the host is exact


class OverlapSpecStep:
    def __init__(
        self, drafter: Drafter, result_queue: deque[tuple[ScheduleBatch, object]], timer: StepTimer
    ) -> None:
        self.drafter = drafter
        self.launched = result_queue  # the scheduler's: launched batches not processed yet
        self.timer = timer

    def prepare(self, batch: ScheduleBatch) -> None:
        with self.timer.phase("draft"):
            plan = self._plan(batch)
        if plan.exact and not any(plan.drafts):
            for req in batch.reqs:
                req.kv_allocated_len, req.spec_inflight = 0, None
            batch.prepare_for_decode()
            return
        trees = _host_trees(plan.drafts, batch.device)
        if not batch.check_verify_mem(trees):
            plan.drafts = [[] for _ in batch.reqs]
            trees = _host_trees(plan.drafts, batch.device)
        batch.prepare_for_verify(trees)
        batch.future_verify = self._future(batch, trees, plan)
        for req, drafts, expected in zip(batch.reqs, plan.drafts, plan.expected):
            req.spec_inflight = InflightStep(drafts, expected, len(req.output_ids))

    def _plan(self, batch: ScheduleBatch) -> _Plan:
        inflight = self.launched[-1][0] if self.launched else None
        flying = {}
        if inflight is not None:
            verify = inflight.forward_mode.is_target_verify()
            flying = {id(r): verify for r in inflight.reqs}
        extras = [_extra(r, flying) for r in batch.reqs]
        exact = all(
            not (flying.get(id(r)) and r.spec_inflight and r.spec_inflight.drafts) for r in batch.reqs
        )
        fault_point("drafter")
        proposed = self.drafter.propose(batch, extras)
        drafts, expected = [], []
        for extra, tokens in zip(extras, proposed):
            if extra is None:  # nothing in flight: drafts after its known tokens
                drafts.append(tokens)
                expected.append(None)
            else:  # after its step in flight; no proposal: an empty expectation, never met
                drafts.append(tokens[1:])
                expected.append(extra + tokens[:1] if tokens else [])
        return _Plan(drafts, expected, exact)

    def _future(self, batch: ScheduleBatch, trees: DraftTrees, plan: _Plan) -> FutureVerify:
        known = [finished_kv_len(r) for r in batch.reqs]
        ends = batch.seq_lens_cpu.tolist()
        width = max(e - k for e, k in zip(ends, known))
        start = int64_tensor(known)
        positions = (start.view(-1, 1) + torch.arange(width)).clamp(max=batch.seq_lens_cpu.view(-1, 1) - 1)
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.to(table.device).view(-1, 1)
        window = table[rows, positions.to(table.device)].to(torch.int64)
        e_width = max([len(e) for e in plan.expected if e is not None], default=1)
        expected = np.full((batch.batch_size(), e_width), -1, dtype=np.int64)
        for i, e in enumerate(plan.expected):
            expected[i, : len(e or ())] = e or ()
        e_lens = [NO_EXPECTATION if e is None else len(e) for e in plan.expected]
        device = batch.device
        return FutureVerify(
            drafts=trees.tokens,
            num_nodes=trees.num_nodes,
            expected=torch.from_numpy(expected).to(device),
            expected_len=int64_tensor(e_lens, device),
            window=window.to(device),
            window_start=start.to(device),
            steps_base=int64_tensor([len(r.output_ids) for r in batch.reqs], device),
            expects_bonus_only=[e is not None and len(e) == 1 for e in plan.expected],
        )


def _extra(req: Req, flying: dict[int, bool]) -> list[int] | None:
    """The tokens its step in flight is assumed to add before its bonus: its drafts, if they held
    (None: no step in flight; its tokens are all known)."""
    if id(req) not in flying:
        return None
    step = req.spec_inflight
    if not flying[id(req)] or step is None or not step.drafts_held(req.output_ids):
        return []
    return list(step.drafts)


def _host_trees(drafts: list[list[int]], device: torch.device | str) -> DraftTrees:
    """Chains whose root (the token of the step in flight) is a stand-in, resolved on the stream."""
    width = max(len(d) for d in drafts) + 1
    chains = [(np.array([0, *d], dtype=np.int64), np.arange(-1, len(d))) for d in drafts]
    return DraftTrees.from_drafts(chains, width, device)
