"""The fair orders (hrrn, shortest-prefill-first, lpm with aging, dlpm) and the retraction order on
hand-made queues, a starvation bound under a continuous hot-prefix stream, and DLPM's deficit
counters over a scripted trace. No model; the clocks are the policy's own counters."""

from __future__ import annotations

import math

import pytest
import torch
from sched_utils import order

from radixengine.managers.fair_policy import FairPolicy, deficit_order, uncached_len
from radixengine.managers.req import Req
from radixengine.managers.retraction_policy import retraction_order
from radixengine.managers.schedule_policy import SchedulePolicy
from radixengine.mem_cache.allocator import TokenToKVPoolAllocator
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.mem_cache.radix_cache import RadixCache
from radixengine.sampling.sampling_params import SamplingParams

_arrival = iter(range(1, 1_000_000))
_unique = iter(range(10_000, 10_000_000))


def make_req(rid: str, ids: list[int], tenant: str | None = None, priority: int | None = None) -> Req:
    req = Req(rid, None, ids, SamplingParams(max_new_tokens=8), priority=priority, routing_key=tenant)
    req.time_stats.wait_queue_entry_time = float(next(_arrival))
    return req


def fresh(n: int) -> list[int]:
    return [next(_unique) for _ in range(n)]


def make_tree() -> RadixCache:
    allocator = TokenToKVPoolAllocator(4096, torch.float32, "cpu")
    return RadixCache(ReqToTokenPool(8, 256, "cpu"), allocator, page_size=1)


def rids(queue: list[Req]) -> list[str]:
    return [r.rid for r in queue]


def cached_req(rid: str, cached: int, uncached: int, tree: RadixCache, tenant: str | None = None) -> Req:
    prefix = fresh(cached)
    if cached:
        tree.insert(prefix)
    return make_req(rid, prefix + fresh(uncached), tenant)


# HRRN ----------------------------------------------------------------------------------------


def test_hrrn_orders_by_wait_over_uncached_length():
    """Wait in computed prefill tokens over uncached tokens: all waited 1000 tokens, so the
    shortest first; a cached prefix shortens the uncached part."""
    tree = make_tree()
    long, mid, short = (
        cached_req("long", 0, 100, tree),
        cached_req("mid", 0, 30, tree),
        cached_req("short", 0, 10, tree),
    )
    cached = cached_req("cached", 95, 5, tree)  # 100 tokens, 95 cached: shorter than `short`
    fair = FairPolicy()
    queue = [long, mid, cached, short]
    for r in queue:
        r.arrival_processed_tokens = 0
    fair.processed_tokens = 1000
    order(SchedulePolicy("hrrn", tree, fair=fair), queue)
    assert rids(queue) == ["cached", "short", "mid", "long"]


def test_hrrn_a_long_wait_overtakes_a_short_new_request():
    tree = make_tree()
    fair = FairPolicy(processed_tokens=100_000)
    old_long, new_short = cached_req("old_long", 0, 100, tree), cached_req("new_short", 0, 1, tree)
    old_long.arrival_processed_tokens = 0
    queue = [new_short, old_long]  # new_short is stamped now: it has waited nothing
    order(SchedulePolicy("hrrn", tree, fair=fair), queue)
    assert rids(queue) == ["old_long", "new_short"]


def test_hrrn_clock_is_the_prefill_work_and_admission_restarts_the_wait():
    fair = FairPolicy()
    req = make_req("r", fresh(20))
    fair.observe_queue([req])
    assert req.arrival_processed_tokens == 0 and req.waiting_passes == 1
    other = make_req("o", fresh(50))
    other.extend_input_len = 50
    fair.on_prefill_batch([other])
    assert fair.processed_tokens == 50
    fair.observe_queue([req])
    assert req.arrival_processed_tokens == 0 and req.waiting_passes == 2
    req.extend_input_len = 20
    fair.on_prefill_batch([req])  # admitted: a later retraction starts a new wait
    assert req.arrival_processed_tokens is None and req.waiting_passes == 0


# Shortest prefill first ---------------------------------------------------------------------


def test_shortest_prefill_first_uses_uncached_work_and_arrival_on_ties():
    tree = make_tree()
    cached = cached_req("cached", 4000, 16, tree)
    short, long = cached_req("short", 0, 32, tree), cached_req("long", 0, 1024, tree)
    same = cached_req("same", 0, 32, tree)  # ties with short, arrived later
    queue = [long, same, short, cached]
    order(SchedulePolicy("shortest-prefill-first", tree), queue)
    assert rids(queue) == ["cached", "short", "same", "long"]


def test_shortest_prefill_first_counts_retracted_output():
    tree = make_tree()
    replay = cached_req("replay", 100, 16, tree)
    replay.output_ids.extend([5] * 64)  # retracted after 64 tokens: they are prefilled again
    short = cached_req("short", 0, 32, tree)
    queue = [replay, short]
    order(SchedulePolicy("shortest-prefill-first", tree), queue)
    assert [uncached_len(r) for r in queue] == [32, 80]
    assert rids(queue) == ["short", "replay"]


def test_fair_orders_put_in_batch_sharers_last():
    """Two waiting requests share an uncached 40-token prefix: the second waits for the first to
    cache it, under every cache-aware order."""
    for name in ("hrrn", "shortest-prefill-first", "dlpm"):
        tree = make_tree()
        shared = fresh(40)
        first, sharer = make_req("first", shared + fresh(5)), make_req("sharer", shared + fresh(1))
        other = make_req("other", fresh(300))
        queue = [first, sharer, other]
        order(SchedulePolicy(name, tree), queue)
        assert rids(queue)[-1] == "sharer", name


# LPM with aging ------------------------------------------------------------------------------


def test_aged_lpm_order_moves_with_waiting_passes():
    tree = make_tree()
    hot = cached_req("hot", 50, 5, tree)
    cold = cached_req("cold", 0, 5, tree)
    cold.waiting_passes = 7  # observe_queue adds one: 8 passes x 8 tokens = 64 > 50 + 1 x 8
    queue = [hot, cold]
    order(SchedulePolicy("lpm", tree, fair=FairPolicy(lpm_aging_tokens_per_pass=8)), queue)
    assert rids(queue) == ["cold", "hot"]
    cold.waiting_passes, hot.waiting_passes = 5, 0  # 6 x 8 = 48 < 50 + 8
    order(SchedulePolicy("lpm", tree, fair=FairPolicy(lpm_aging_tokens_per_pass=8)), queue)
    assert rids(queue) == ["hot", "cold"]


HOT_PREFIX_LEN = 120


def passes_until_cold_admitted(policy: str, fair: FairPolicy, max_passes: int = 400) -> int | None:
    """A continuous hot stream: every pass one new request of the hot tenant (its 120-token
    system prompt cached, an 8-token tail) arrives and one request is admitted, the head of the
    queue. A cold request (64 tokens, nothing cached) waits from pass 1. Returns the pass at
    which the cold request is admitted, or None if it never is."""
    tree = make_tree()
    system = fresh(HOT_PREFIX_LEN)
    tree.insert(system)
    sched_policy = SchedulePolicy(policy, tree, fair=fair)
    cold = make_req("cold", fresh(64), tenant="cold")
    queue = [make_req("hot0", system + fresh(8), tenant="hot"), cold]
    for n in range(1, max_passes + 1):
        queue.append(make_req(f"hot{n}", system + fresh(8), tenant="hot"))
        order(sched_policy, queue)
        head = queue.pop(0)
        head.extend_input_len = uncached_len(head)
        fair.on_prefill_batch([head])
        if head is cold:
            return n
    return None


def test_plain_lpm_starves_the_cold_request():
    assert passes_until_cold_admitted("lpm", FairPolicy()) is None


@pytest.mark.parametrize("aging", [4, 16, 60])
def test_aged_lpm_admits_the_cold_request_within_the_bound(aging):
    """The bound: once a request has waited max_prefix / N passes, nothing that came after it
    ranks higher; here one hot request is ahead of it at arrival, plus one pass for the tie."""
    passes = passes_until_cold_admitted("lpm", FairPolicy(lpm_aging_tokens_per_pass=aging))
    bound = math.ceil((HOT_PREFIX_LEN + 8) / aging) + 2
    assert passes is not None and passes <= bound


def test_hrrn_and_dlpm_admit_the_cold_request_under_the_hot_stream():
    assert passes_until_cold_admitted("hrrn", FairPolicy()) <= 2
    # dlpm: the cold tenant's fresh quantum is more credit than the hot tenant has left after
    # its first request (the hot request queued before it goes first).
    assert passes_until_cold_admitted("dlpm", FairPolicy(dlpm_quantum_tokens=64)) <= 2


def test_shortest_prefill_first_starves_the_long_cold_request():
    """SGLang's shortest-prefill-first has no aging: the stream of 8-token tails wins forever."""
    assert passes_until_cold_admitted("shortest-prefill-first", FairPolicy()) is None


# DLPM ----------------------------------------------------------------------------------------


def test_dlpm_cache_hits_first_within_the_allowance_then_the_other_tenant():
    """Tenant a: three requests, one with a cached prefix; tenant b: one. Each tenant starts
    with a 100-token quantum; a request is charged its uncached tokens and its 8 of output: a's
    cache hit (18) first (the tie goes to the better LPM request), then b's (88: b has 100 left,
    a 82), then a's next (103, a is now in debt), then a's last once the round is replenished."""
    tree = make_tree()
    a_miss1 = cached_req("a_miss1", 0, 95, tree, "a")
    a_miss2 = cached_req("a_miss2", 0, 60, tree, "a")
    b_miss = cached_req("b_miss", 0, 80, tree, "b")
    a_hit = cached_req("a_hit", 50, 10, tree, "a")
    queue = [a_miss1, a_miss2, b_miss, a_hit]
    order(SchedulePolicy("dlpm", tree, fair=FairPolicy(dlpm_quantum_tokens=100)), queue)
    assert rids(queue) == ["a_hit", "b_miss", "a_miss1", "a_miss2"]


def test_dlpm_a_tenant_arriving_mid_round_goes_before_the_rest_of_the_hot_round():
    """The cold tail's case. The bound: a tenant that starts waiting with a fresh quantum is
    placed after at most one request of each tenant that still holds a whole quantum. Here the
    hot tenant (cache hits, charged 16 tokens each: 8 uncached, 8 of output; a 128-token
    quantum) has spent 32 of its quantum when the cold request arrives: the cold one, with more
    credit left, goes first (it used to wait for the 6 hot requests left in the round).
    Arriving at the start of a round, it goes second, after one hot request."""
    tree = make_tree()
    system = fresh(HOT_PREFIX_LEN)
    tree.insert(system)
    fair = FairPolicy(dlpm_quantum_tokens=128)
    policy = SchedulePolicy("dlpm", tree, fair=fair)
    queue = [make_req(f"hot{i}", system + fresh(8), tenant="hot") for i in range(12)]
    for _ in range(2):
        order(policy, queue)
        head = queue.pop(0)
        head.extend_input_len = uncached_len(head)
        fair.on_prefill_batch([head])
    assert fair.deficits == {"hot": 96}
    queue.append(make_req("cold", fresh(64), tenant="cold"))
    order(policy, queue)
    assert rids(queue)[0] == "cold"

    fresh_fair = FairPolicy(dlpm_quantum_tokens=128)
    queue = [make_req(f"hot{i}", system + fresh(8), tenant="hot") for i in range(12)]
    queue.append(make_req("cold", fresh(64), tenant="cold"))
    order(SchedulePolicy("dlpm", tree, fair=fresh_fair), queue)
    assert rids(queue)[:2] == ["hot0", "cold"]


def test_deficit_order_replenishes_until_someone_has_credit():
    reqs = [make_req(f"x{i}", fresh(500), "x") for i in range(3)] + [make_req("y", fresh(10), "y")]
    order, rounds = deficit_order(reqs, {"x": -2000, "y": -5}, quantum=100)
    assert rids(order) == ["y", "x0", "x1", "x2"]
    # One round for y (x stays in debt), then 20 for x (y, placed by then, is capped at a
    # quantum), then 5 for each of x1 and x2.
    assert [(r.position, r.credit) for r in rounds] == [(0, 100), (1, 2000), (2, 500), (3, 500)]


def run_scripted_trace(quantum: int, budget: int, passes: int) -> tuple[FairPolicy, list[dict[str, int]]]:
    """Three tenants that always have more waiting than a quantum and a budget: `hot` (a cached
    200-token prefix and a 10-token tail), `mid` (40 tokens) and `big` (90 tokens), 600 tokens
    worth each.
    Each pass admits the head of the order while `budget` prefill tokens last (PrefillAdder's
    rule: stop at the first that does not fit). Returns the policy and, after every pass, each
    tenant's served tokens and the credit it was given so far (served + deficit)."""
    tree = make_tree()
    system = fresh(200)
    tree.insert(system)
    make = {
        "hot": lambda: make_req("hot", system + fresh(10), "hot"),
        "mid": lambda: make_req("mid", fresh(40), "mid"),
        "big": lambda: make_req("big", fresh(90), "big"),
    }
    fair = FairPolicy(dlpm_quantum_tokens=quantum)
    policy = SchedulePolicy("dlpm", tree, fair=fair, enable_in_batch_prefix_caching=False)
    queue = [make[t]() for t, n in (("hot", 60), ("mid", 15), ("big", 7)) for _ in range(n)]
    history = []
    for _ in range(passes):
        order(policy, queue)
        admitted, left = [], budget
        while queue and uncached_len(queue[0]) <= left:
            req = queue.pop(0)
            req.extend_input_len = uncached_len(req)
            left -= req.extend_input_len
            admitted.append(req)
        fair.on_prefill_batch(admitted)
        queue += [make[r.routing_key]() for r in admitted]
        history.append(
            {
                t: (fair.served_tokens.get(t, 0), fair.served_tokens.get(t, 0) + d)
                for t, d in fair.deficits.items()
            }
        )
    return fair, history


@pytest.mark.parametrize("quantum,budget", [(90, 150), (200, 300), (500, 256)])
def test_dlpm_gives_each_tenant_its_share_within_one_request(quantum, budget):
    """After every pass all tenants were credited the same, and each one's served tokens are
    within one request (98 tokens at most: 90 of prompt, 8 of output) above it and one quantum (credited, not yet used)
    below it."""
    fair, history = run_scripted_trace(quantum, budget, passes=300)
    assert set(fair.served_tokens) == {"hot", "mid", "big"} and min(fair.served_tokens.values()) > 2000
    for point in history:
        credits = {credit for _, credit in point.values()}
        assert len(credits) == 1
        credit = credits.pop()
        assert all(credit - quantum <= served < credit + 98 for served, _ in point.values())


def test_lpm_alone_gives_the_hot_tenant_everything():
    """The same trace under plain LPM: the cached tenant is always first (50 requests charged
    18 tokens each: a 10-token tail and 8 of output)."""
    tree = make_tree()
    system = fresh(200)
    tree.insert(system)
    fair = FairPolicy()
    policy = SchedulePolicy("lpm", tree, fair=fair, enable_in_batch_prefix_caching=False)
    queue = [make_req("hot", system + fresh(10), "hot") for _ in range(4)] + [
        make_req("mid", fresh(40), "mid") for _ in range(4)
    ]
    for _ in range(50):
        order(policy, queue)
        req = queue.pop(0)
        req.extend_input_len = uncached_len(req)
        fair.on_prefill_batch([req])
        queue.append(make_req(req.rid, (system if req.rid == "hot" else []) + fresh(10), req.routing_key))
    assert fair.served_tokens == {"hot": 900}


def test_dlpm_idle_tenant_drops_credit_and_keeps_debt():
    fair = FairPolicy(dlpm_quantum_tokens=100)
    fair.refresh_deficits({"a", "b"})
    assert fair.deficits == {"a": 100, "b": 100}
    fair.deficits["a"], fair.deficits["b"] = -30, 40
    fair.refresh_deficits({"c"})  # a and b idle: b's credit goes, a's debt stays; c starts with one quantum
    assert fair.deficits == {"a": -30, "c": 100}
    fair.deficits["c"] = 0
    fair.refresh_deficits({"a", "c"})  # nobody has credit: one round for everyone waiting
    assert fair.deficits == {"a": 70, "c": 100}


# Retraction order ----------------------------------------------------------------------------


def decoded(rid: str, prompt: int, output: int, priority: int | None = None) -> Req:
    req = make_req(rid, fresh(prompt), priority=priority)
    req.output_ids = [3] * output
    return req


def victims(reqs: list[Req], policy: str, low_first: bool = False) -> list[str]:
    """Retraction pops from the end of the order: the first victim first."""
    return [reqs[i].rid for i in reversed(retraction_order(reqs, policy, low_first))]


def test_length_retraction_takes_the_fewest_decoded_then_longest_prompt():
    reqs = [decoded("much", 10, 50, 9), decoded("little_long", 100, 2, -5), decoded("little_short", 10, 2, 0)]
    assert victims(reqs, "length") == ["little_long", "little_short", "much"]


def test_priority_retraction_takes_the_least_important_first():
    reqs = [
        decoded("high", 10, 2, 9),
        decoded("low_long", 10, 50, -5),
        decoded("low_short", 10, 2, -5),
        decoded("unset", 10, 60),
    ]
    # Higher values first (the default): no priority is the least important, then -5 by length.
    assert victims(reqs, "priority") == ["unset", "low_short", "low_long", "high"]
    # Lower values first: 9 is the least important, and an unset one too (sys.maxsize).
    assert victims(reqs, "priority", low_first=True) == [
        "unset",
        "high",
        "low_short",
        "low_long",
    ]


def test_dlpm_past_the_fallback_length_keeps_the_deficits_without_matching():
    """Like lpm's fallback to fcfs on a long queue (no prefix matching), but tenants still take
    turns: arrival order within a tenant, each tenant's quantum in turn."""
    tree = make_tree()
    system = fresh(100)
    tree.insert(system)
    hot = [make_req(f"h{i}", system + fresh(30), "hot") for i in range(6)]
    cold = make_req("cold", fresh(30), "cold")
    queue = [*hot, cold]
    policy = SchedulePolicy("dlpm", tree, fair=FairPolicy(dlpm_quantum_tokens=130), lpm_fallback_queue_len=4)
    assert order(policy, queue) is False  # nothing matched: the adder matches as it goes
    assert all(len(r.prefix_indices) == 0 for r in queue)
    # Unmatched, a hot request costs its 130 tokens (and 8 of output): one per quantum, the cold one second.
    assert rids(queue)[:3] == ["h0", "cold", "h1"]
