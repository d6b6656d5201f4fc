"""SchedulePolicy orders and PrefillAdder budgets, without a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from sched_utils import order

from radixengine.managers.prefill_adder import CLIP_MAX_NEW_TOKENS, AddReqResult, PrefillAdder
from radixengine.managers.schedule_batch import Req
from radixengine.managers.schedule_policy import CacheAgnosticPolicy, PrefixTrie, SchedulePolicy
from radixengine.mem_cache.allocator import TokenToKVPoolAllocator
from radixengine.mem_cache.chunk_cache import ChunkCache
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.mem_cache.radix_cache import RadixCache
from radixengine.sampling.sampling_params import SamplingParams

_arrival = iter(range(1, 1_000_000))


def make_req(rid: str, ids: list[int], max_new_tokens: int = 16, priority: int | None = None) -> Req:
    req = Req(
        rid, None, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), priority=priority
    )
    req.time_stats.wait_queue_entry_time = float(next(_arrival))
    return req


def make_tree(size: int = 1024) -> RadixCache:
    allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu")
    return RadixCache(ReqToTokenPool(8, 256, "cpu"), allocator, page_size=1)


def rids(queue: list[Req]) -> list[str]:
    return [r.rid for r in queue]


# Orders ----------------------------------------------------------------------------------------


def test_dfs_weight_worked_example_of_seed_001():
    """Root -> A -> {C, D}; Root -> B -> E -> {F, G}. Waiting: 4 at C, 2 at D, 2 at F, 2 at G.
    Weights A 6 > B 4, so A's subtree first (C before D), then B-E-F, then B-E-G."""
    A, C, D = [1, 2, 3], [4, 5], [6, 7]
    B, E, F, G = [10, 11], [12, 13], [14], [15]
    tree = make_tree()
    for seq in (A + C, A + D, B + E + F, B + E + G, B + [99]):  # B + [99]: B is its own node
        tree.insert(seq)
    ends = {"C": A + C, "D": A + D, "F": B + E + F, "G": B + E + G}
    arrival = ["F1", "G1", "D1", "C1", "F2", "C2", "G2", "D2", "C3", "C4"]
    queue = [make_req(name, ends[name[0]] + [200 + i]) for i, name in enumerate(arrival)]
    order(SchedulePolicy("dfs-weight", tree), queue)
    assert rids(queue) == ["C1", "C2", "C3", "C4", "D1", "D2", "F1", "F2", "G1", "G2"]
    assert queue[0].last_node.key == tuple(C)


def test_lpm_sorts_by_cached_prefix_and_falls_back_to_fcfs():
    tree = make_tree()
    tree.insert(list(range(10, 50)))  # 40 cached tokens
    queue = [
        make_req("none", [200, 201, 202]),
        make_req("p10", list(range(10, 20)) + [201]),
        make_req("p40", list(range(10, 50)) + [202]),
        make_req("p25", list(range(10, 35)) + [203]),
    ]
    policy = SchedulePolicy("lpm", tree, lpm_fallback_queue_len=4)
    assert order(policy, queue) is True
    assert rids(queue) == ["p40", "p25", "p10", "none"]
    assert [len(r.prefix_indices) for r in queue] == [40, 25, 10, 0]

    longer = queue + [make_req("late", list(range(10, 50)) + [204])]
    before = rids(longer)
    assert order(policy, longer) is False  # 5 > 4: plain FCFS, nothing matched
    assert rids(longer) == before


def test_lpm_in_batch_prefix_caching_deprioritizes_sharers():
    shared = list(range(100, 140))  # 40 tokens nobody has cached
    queue = [
        make_req("s1", shared + [1]),
        make_req("s2", shared + [2]),
        make_req("other", [50, 51, 52]),
        make_req("s3", shared + [3]),
    ]
    order(SchedulePolicy("lpm", make_tree()), queue)
    assert rids(queue) == ["s1", "other", "s2", "s3"]
    queue.sort(key=lambda r: r.rid)
    order(SchedulePolicy("lpm", make_tree(), enable_in_batch_prefix_caching=False), queue)
    assert rids(queue) == ["other", "s1", "s2", "s3"]  # all prefixes 0: stable order


def test_fcfs_lof_random_and_priorities():
    tree = make_tree()
    queue = [
        make_req(f"r{i}", [i + 2], max_new_tokens=m, priority=p)
        for i, (m, p) in enumerate([(8, 0), (32, 5), (16, 5), (64, -1)])
    ]
    q = list(queue)
    SchedulePolicy("fcfs", tree).calc_priority(q)
    assert rids(q) == ["r0", "r1", "r2", "r3"]
    SchedulePolicy("fcfs", tree, enable_priority_scheduling=True).calc_priority(q)
    assert rids(q) == ["r1", "r2", "r0", "r3"]  # larger is more important; ties by arrival
    SchedulePolicy("fcfs", tree, True, schedule_low_priority_values_first=True).calc_priority(q)
    assert rids(q) == ["r3", "r0", "r1", "r2"]
    SchedulePolicy("lof", tree).calc_priority(q)
    assert rids(q) == ["r3", "r1", "r2", "r0"]
    SchedulePolicy("lof", tree, enable_priority_scheduling=True).calc_priority(q)
    assert rids(q) == ["r1", "r2", "r0", "r3"]
    SchedulePolicy("random", tree).calc_priority(q)
    assert sorted(rids(q)) == ["r0", "r1", "r2", "r3"]


def test_unknown_policy_raises_and_cache_aware_degrades_without_tree():
    with pytest.raises(ValueError, match="unknown schedule policy 'sjf'"):
        SchedulePolicy("sjf", make_tree())
    chunk = ChunkCache(None, None)
    assert SchedulePolicy("lpm", chunk).policy == CacheAgnosticPolicy.FCFS
    assert SchedulePolicy("dfs-weight", chunk).policy == CacheAgnosticPolicy.FCFS


def test_prefix_trie():
    trie = PrefixTrie()
    trie.insert([1, 2, 3, 4, 5])
    trie.insert([1, 2, 9])
    trie.insert(list(range(100, 300)))
    assert trie.match([1, 2, 3, 4, 5, 6]) == 5
    assert trie.match([1, 2, 9, 9]) == 3
    assert trie.match([1, 2, 7]) == 2
    assert trie.match([5]) == 0
    assert trie.match(list(range(100, 250)) + [0]) == 150
    assert trie.match(list(range(100, 180)) + [7] + list(range(181, 300))) == 80


def test_prefix_trie_namespaces():
    """A LoRA adapter's prefix (extra_key) is not another's nor the base model's: a request is
    not deferred for a prefix whose KV it could not reuse."""
    trie = PrefixTrie()
    trie.insert([1, 2, 3, 4], extra_key="a")
    assert trie.match([1, 2, 3, 4], "a") == 4
    assert trie.match([1, 2, 3, 4]) == 0
    assert trie.match([1, 2, 3, 4], "b") == 0


# PrefillAdder ----------------------------------------------------------------------------------


@dataclass
class FakeRunningBatch:
    """The part of ScheduleBatch that PrefillAdder uses, recording releases."""

    reqs: list[Req]
    released: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.reqs

    def release_req(
        self, idx: int, remaining: int, retract_decode_steps: int, keep_prefix: bool = False
    ) -> None:
        self.released.append(self.reqs[idx].rid)
        self.reqs[idx].reset_for_retract()

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


def make_adder(
    tree, running=None, ratio=0.5, rem_input=1000, rem_chunk=None, page_size=1, low_first=False
) -> PrefillAdder:
    return PrefillAdder(
        page_size,
        tree,
        tree.token_to_kv_pool_allocator,
        running,
        ratio,
        rem_input,
        rem_chunk,
        schedule_low_priority_values_first=low_first,
    )


def ready(req: Req, tree) -> Req:
    req.init_next_round_input(tree)
    return req


def test_adder_reserves_running_decode_and_charges_admissions():
    tree = make_tree(1000)
    running = [make_req("a", [2] * 10, max_new_tokens=100), make_req("b", [3] * 10, max_new_tokens=9000)]
    running[0].output_ids = [5] * 20
    adder = make_adder(tree, FakeRunningBatch(running), ratio=0.5)
    assert adder.rem_total_token_offset == pytest.approx(80 * 0.5 + CLIP_MAX_NEW_TOKENS * 0.5)
    assert adder.rem_total_tokens == pytest.approx(1000 - 40 - 2048)
    assert adder.add_one_req(ready(make_req("c", [4] * 10), tree)) == AddReqResult.NO_TOKEN

    adder = make_adder(tree, ratio=0.5)
    req = ready(make_req("d", [4] * 50, max_new_tokens=30), tree)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE
    assert adder.rem_total_token_offset == 50 + 30 and adder.cur_rem_token_offset == 50
    assert adder.can_run_list == [req]


def test_adder_first_request_may_exceed_input_budget():
    tree = make_tree()
    adder = make_adder(tree, rem_input=16)
    first = ready(make_req("big", list(range(2, 60))), tree)
    assert adder.add_one_req(first) == AddReqResult.OTHER  # admitted, budget now spent
    assert adder.can_run_list == [first]
    assert adder.add_one_req(ready(make_req("next", [2, 3, 4]), tree)) == AddReqResult.OTHER
    assert adder.can_run_list == [first]


def test_adder_chunks_one_request_and_locks_prefix():
    tree = make_tree()
    tree.insert(list(range(2, 22)))  # 20 cached
    adder = make_adder(tree, rem_chunk=16)
    req = ready(make_req("long", list(range(2, 80))), tree)
    assert len(req.prefix_indices) == 20 and req.extend_input_len == 58
    assert adder.add_one_req(req) == AddReqResult.OTHER  # chunk budget spent
    plan = adder.plan(None, batch_is_full=False)
    assert plan.chunked_req is req and plan.reqs == [req] and plan.extend_lens == [16]
    assert req.extend_input_len == 58  # the plan is applied by the scheduler, not the adder
    assert tree.protected_size() == 20  # locked until the cache takes the chunk
    assert adder.rem_total_token_offset == 16  # no output reserve for a partial chunk

    adder2 = make_adder(tree, rem_chunk=64)
    req.init_next_round_input()  # keeps the prefix (no re-match): 58 left
    assert adder2.add_chunked_req(req) is None  # fits: completes
    assert adder2.plan(None, batch_is_full=False).extend_lens == [58]


def test_adder_pages_round_up():
    tree = make_tree()
    adder = make_adder(tree, page_size=16)
    req = ready(make_req("r", list(range(2, 22))), tree)  # 20 tokens
    adder.add_one_req(req)
    assert adder.cur_rem_token_offset == 32


def _running_with_priorities(prios: list[int], finished: set[int] = frozenset()) -> FakeRunningBatch:
    reqs = []
    for i, p in enumerate(prios):
        r = make_req(f"run{i}", [2] * 8, max_new_tokens=100, priority=p)
        if i in finished:
            r.finished_reason = {"type": "length", "length": 100}
        reqs.append(r)
    return FakeRunningBatch(reqs)


def test_preempt_to_schedule_takes_only_what_it_needs():
    # Pool of 400; four running requests each reserve 100 * 1.0 tokens: nothing is left.
    tree = make_tree(400)
    batch = _running_with_priorities([0, 0, 50, 0])
    adder = make_adder(tree, batch, ratio=1.0)
    newcomer = ready(make_req("vip", [3] * 50, max_new_tokens=100, priority=100), tree)
    assert adder.add_one_req(newcomer) == AddReqResult.NO_TOKEN
    assert adder.preempt_to_schedule(newcomer)
    # need = 150 - 0: two victims of 100 each; worst first (priority 0, newest first).
    assert sorted(batch.released) == ["run1", "run3"]
    assert all(r.is_retracted for r in adder.preempt_list)
    assert adder.rem_total_token_offset == pytest.approx(200)
    assert rids(batch.reqs) == ["run0", "run2"]
    assert adder.add_one_req(newcomer) != AddReqResult.NO_TOKEN


def test_preempt_respects_threshold_and_skips_finished():
    tree = make_tree(400)
    batch = _running_with_priorities([0, 95, 0, 0], finished={0})
    adder = make_adder(tree, batch, ratio=1.0)
    vip = ready(make_req("vip", [3] * 150, max_new_tokens=200, priority=100), tree)
    # need 250, but only run2 and run3 qualify (run1 is within the threshold, run0 finished)
    assert not adder.preempt_to_schedule(vip)
    assert batch.released == []
    small = ready(make_req("small", [3] * 20, max_new_tokens=20, priority=100), tree)
    assert adder.preempt_to_schedule(small)
    assert batch.released == ["run3"]

    batch = _running_with_priorities([5, 30, 50])
    adder = make_adder(tree, batch, ratio=1.0, low_first=True)
    urgent = ready(make_req("urgent", [3] * 20, max_new_tokens=20, priority=1), tree)
    assert adder.preempt_to_schedule(urgent)
    assert batch.released == ["run2"]  # the largest value is the least important
