"""Waiting-queue orders that bound how long a request can wait, and the counters they keep.

- `hrrn` (SGLang's): highest response ratio next. A request's expected service is its uncached
  prefill length; its wait is counted in prefill tokens the engine computed since it entered the
  queue (a clock that moves with the work done, not the wall). ratio = wait / uncached, so short
  and cached requests go first and a long one rises until it is served; ties in arrival order.
- `shortest-prefill-first` (SGLang's): fewest uncached tokens first (retracted output included),
  ties in arrival order. Shortest-job-first: it can starve long prompts.
- `lpm` with `--lpm-aging-tokens-per-pass N` > 0: the longest-prefix-match score grows by N tokens
  for each scheduling pass a request has waited, so once it has waited context_length / N passes
  it is ahead of any request that came after it: no request waits beyond that bound plus the
  requests ahead of it at arrival.
- `dlpm`: deficit round robin over tenants (`Req.routing_key`) combined with LPM. Each tenant
  holds a deficit counter in tokens; the next request is the best one in LPM order of the
  tenant with the most credit left (ties: the tenant whose best request ranks first in LPM
  order), charged the tokens it will compute (its uncached prefill and its output budget: the
  decode slots are as scarce as prefill) when it is admitted, whatever the chunk size; when
  none is positive, every waiting tenant gets the same quantum. Cache hits go first within a tenant's allowance, and over any stretch where tenants
  keep requests waiting, their charged tokens differ by at most a quantum plus one
  request. Serving the most credit first interleaves the tenants within a round: a tenant that
  starts waiting with a fresh quantum is placed after at most one request of each tenant that
  still holds a whole quantum, instead of after the rest of every other tenant's round.

All three cache-aware orders put the requests `SchedulePolicy` deprioritized for in-batch prefix
caching last, as LPM does.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixengine.managers.req import Req

FAIR_POLICIES = ("hrrn", "shortest-prefill-first", "dlpm")
DEFAULT_TENANT = ""


def uncached_len(req: Req) -> int:
    """Prefill tokens the request still has to compute (its output too, after a retraction)."""
    return len(req.origin_input_ids) + len(req.output_ids) - len(req.prefix_indices)


def output_budget(req: Req) -> int:
    """Output tokens the request may still decode: `max_new_tokens` less what it has (the real
    length is not known at admission)."""
    return max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)


def service_len(req: Req) -> int:
    """What dlpm charges a tenant for a request: every token it will compute, prefill and decode."""
    return uncached_len(req) + output_budget(req)


def tenant_of(req: Req) -> str:
    return req.routing_key or DEFAULT_TENANT


def _arrival(req: Req) -> float:
    return req.time_stats.wait_queue_entry_time


@dataclass
class FairPolicy:
    """State the orders keep across scheduling passes. `on_prefill_batch` is told of every
    prefill batch; `sort` orders the waiting queue (whose prefixes were just matched)."""

    lpm_aging_tokens_per_pass: int = 0
    dlpm_quantum_tokens: int = 2048
    processed_tokens: int = 0  # prefill tokens computed so far: HRRN's clock
    deficits: dict[str, int] = field(default_factory=dict)
    served_tokens: dict[str, int] = field(default_factory=dict)  # charged per tenant, since start
    # The last dlpm order's replenishments: each applies once a request at or after its
    # position is admitted, so the counters follow the order admission took.
    _position: dict[Req, int] = field(default_factory=dict)
    _rounds: list[Replenish] = field(default_factory=list)

    def handles(self, policy: str) -> bool:
        return policy in FAIR_POLICIES or (policy == "lpm" and self.lpm_aging_tokens_per_pass > 0)

    def observe_queue(self, waiting_queue: list[Req]) -> None:
        """Once per scheduling pass, before sorting: stamp new arrivals with HRRN's clock and age
        every waiting request by one pass."""
        for req in waiting_queue:
            if req.arrival_processed_tokens is None:
                req.arrival_processed_tokens = self.processed_tokens
            req.waiting_passes += 1

    def on_prefill_batch(self, reqs: list[Req], continuing: Req | None = None) -> None:
        """A prefill batch was formed: advance the clock, charge the tenants, and clear the
        requests' waiting stamps (a retracted or preempted request starts a new wait).
        A request is charged its whole `service_len` when it is admitted, so a chunked one
        (`continuing`: its later chunks) costs what it would unchunked."""
        for req in sorted(reqs, key=lambda r: self._position.get(r, -1)):
            position = self._position.get(req, -1)
            while self._rounds and self._rounds[0].position <= position:
                self._rounds.pop(0).apply(self.deficits)
            self.processed_tokens += req.extend_input_len
            if req is not continuing:
                self._charge(tenant_of(req), service_len(req))
            req.start_wait()

    def _charge(self, tenant: str, tokens: int) -> None:
        self.served_tokens[tenant] = self.served_tokens.get(tenant, 0) + tokens
        if tenant in self.deficits:
            self.deficits[tenant] -= tokens

    def sort(self, policy: str, waiting_queue: list[Req], deprioritized: set[Req]) -> None:
        if policy == "hrrn":
            sort_by_hrrn(waiting_queue, deprioritized, self.processed_tokens)
        elif policy == "shortest-prefill-first":
            sort_by_shortest_prefill(waiting_queue, deprioritized)
        elif policy == "lpm":
            sort_by_aged_prefix(waiting_queue, deprioritized, self.lpm_aging_tokens_per_pass)
        elif policy == "dlpm":
            self.sort_by_deficit_lpm(waiting_queue, deprioritized)
        elif policy == "dlpm-unmatched":
            self.sort_by_deficit_lpm(waiting_queue, deprioritized, matched=False)
        else:
            raise ValueError(f"not a fair policy: {policy!r}")

    # DLPM ----------------------------------------------------------------------------------

    def sort_by_deficit_lpm(
        self, waiting_queue: list[Req], deprioritized: set[Req], matched: bool = True
    ) -> None:
        """With `matched` false (a queue too long to match every request, as lpm falls back to
        fcfs), arrival order within a tenant and the last known prefixes for the costs."""
        active = {tenant_of(r) for r in waiting_queue}
        self.refresh_deficits(active)
        if matched:
            key = lambda r: (r in deprioritized, -len(r.prefix_indices), _arrival(r))  # noqa: E731
        else:
            key = _arrival
        lpm = sorted(waiting_queue, key=key)
        order, self._rounds = deficit_order(lpm, dict(self.deficits), self.dlpm_quantum_tokens, active)
        waiting_queue[:] = order
        self._position = {r: i for i, r in enumerate(order)}

    def refresh_deficits(self, active: set[str]) -> None:
        """Deficit round robin's bookkeeping for this pass: an idle tenant drops its credit (it
        keeps a debt), a tenant that starts waiting gets one quantum, and when no waiting tenant
        has credit left, every waiting tenant gets quanta until one has."""
        for tenant in [t for t, d in self.deficits.items() if t not in active and d >= 0]:
            del self.deficits[tenant]
        for tenant in active - self.deficits.keys():
            self.deficits[tenant] = self.dlpm_quantum_tokens
        replenish = Replenish.when_due(self.deficits, active, active, self.dlpm_quantum_tokens, position=0)
        if replenish is not None:
            replenish.apply(self.deficits)


@dataclass
class Replenish:
    """DRR rounds: `credit` tokens to each waiting tenant (none above one quantum), due before
    the request at `position` of the order."""

    position: int
    tenants: frozenset[str]
    credit: int
    quantum: int

    @staticmethod
    def when_due(
        deficits: dict[str, int], waiting: set[str], active: set[str], quantum: int, position: int
    ) -> Replenish | None:
        """When no tenant with a request still `waiting` has credit: the rounds that give one of
        them credit, for every `active` tenant."""
        if not waiting or any(deficits[t] > 0 for t in waiting):
            return None
        rounds = min(math.ceil((1 - deficits[t]) / quantum) for t in waiting)
        return Replenish(position, frozenset(active), rounds * quantum, quantum)

    def apply(self, deficits: dict[str, int]) -> None:
        for t in self.tenants:
            deficits[t] = min(deficits.get(t, 0) + self.credit, self.quantum)


def deficit_order(
    lpm_order: list[Req], deficits: dict[str, int], quantum: int, active: set[str] | None = None
) -> tuple[list[Req], list[Replenish]]:
    """The order admission would follow if every request were admitted: repeatedly the tenant
    with the most credit left (ties: the one whose next request ranks first in LPM order) gives
    its next request in LPM order, charged its `service_len`; and the rounds replenished on
    the way (to the `active` tenants, by default those in the order)."""
    active = {tenant_of(r) for r in lpm_order} if active is None else active
    rank = {req: i for i, req in enumerate(lpm_order)}
    queues: dict[str, deque[Req]] = {}
    for req in lpm_order:
        queues.setdefault(tenant_of(req), deque()).append(req)
    out, rounds = [], []
    while queues:
        ready = [t for t in queues if deficits[t] > 0]
        if not ready:
            replenish = Replenish.when_due(deficits, set(queues), active, quantum, len(out))
            replenish.apply(deficits)
            rounds.append(replenish)
            continue
        tenant = min(ready, key=lambda t: (-deficits[t], rank[queues[t][0]]))
        req = queues[tenant].popleft()
        deficits[tenant] -= service_len(req)
        out.append(req)
        if not queues[tenant]:
            del queues[tenant]
    return out, rounds


# Stateless orders ----------------------------------------------------------------------------


def sort_by_hrrn(waiting_queue: list[Req], deprioritized: set[Req], processed_tokens: int) -> None:
    def key(req: Req) -> tuple:
        uncached = uncached_len(req)
        waited = processed_tokens - (req.arrival_processed_tokens or 0)
        ratio = math.inf if uncached <= 0 else waited / uncached
        return (req in deprioritized, -ratio, _arrival(req))

    waiting_queue.sort(key=key)


def sort_by_shortest_prefill(waiting_queue: list[Req], deprioritized: set[Req]) -> None:
    waiting_queue.sort(key=lambda r: (r in deprioritized, uncached_len(r), _arrival(r)))


def sort_by_aged_prefix(waiting_queue: list[Req], deprioritized: set[Req], tokens_per_pass: int) -> None:
    waiting_queue.sort(
        key=lambda r: (r in deprioritized, -(len(r.prefix_indices) + tokens_per_pass * r.waiting_passes))
    )
