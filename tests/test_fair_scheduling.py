"""The fair policies and the eviction / retraction policies in the real scheduler (tiny model):
greedy outputs equal transformers' under each, with retraction, and the scheduler charges every
prefill token to its tenant."""

from __future__ import annotations

import pytest
from sched_utils import (
    assert_matches_oracle,
    assert_no_leak,
    collect,
    gen_req,
    make_scheduler,
    random_prompts,
    run_to_completion,
)
from test_scheduler_equivalence import SYSTEM_A, run_in_waves, workload

from radixengine.managers.schedule_batch import ScheduleBatch

TENANTS = ("hot", "cold1", "cold2")


def with_tenants(reqs: list) -> list:
    for i, r in enumerate(reqs):
        r.routing_key = TENANTS[i % len(TENANTS)]
    return reqs


FAIR_POLICIES = [
    ("hrrn", {}),
    ("shortest-prefill-first", {}),
    ("dlpm", {"dlpm_quantum_tokens": 32}),
    ("lpm", {"lpm_aging_tokens_per_pass": 4}),
]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("chunk", [16, -1])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no_radix"])
@pytest.mark.parametrize("policy,flags", FAIR_POLICIES, ids=[p for p, _ in FAIR_POLICIES])
def test_greedy_matches_transformers_under_fair_policies(policy, flags, radix, page_size, chunk, overlap):
    sched = make_scheduler(
        schedule_policy=policy,
        disable_radix_cache=not radix,
        page_size=page_size,
        chunked_prefill_size=chunk,
        overlap=overlap,
        **flags,
    )
    reqs = with_tenants(workload("fair"))
    results = run_in_waves(sched, reqs)
    assert_matches_oracle(reqs, results)
    if radix:
        assert sched.stats.num_cached_tokens > 0
    fair = sched.policy.fair
    # Every computed prefill token was charged to a tenant (every tenant had some), and each
    # request's output budget once (nothing is retracted here).
    assert sched.stats.num_retracted_reqs == 0
    outputs = sum(r.sampling_params.max_new_tokens for r in reqs)
    assert sum(fair.served_tokens.values()) == sched.stats.num_prefill_tokens + outputs
    assert set(fair.served_tokens) == set(TENANTS)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "flags",
    [
        {"schedule_policy": "dlpm", "radix_eviction_policy": "lfu"},
        {"schedule_policy": "hrrn", "radix_eviction_policy": "slru"},
        {
            "schedule_policy": "fcfs",
            "radix_eviction_policy": "priority",
            "retraction_policy": "priority",
            "enable_priority_scheduling": True,
        },
        {"schedule_policy": "lpm", "lpm_aging_tokens_per_pass": 8, "retraction_policy": "length"},
    ],
    ids=["dlpm-lfu", "hrrn-slru", "priority-priority", "aged-lpm"],
)
def test_retraction_keeps_tokens_under_each_policy(flags, page_size):
    sched = make_scheduler(
        page_size=page_size,
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,  # an optimistic estimate: admits more than decode can hold
        **flags,
    )
    prompts = random_prompts(11, 8, 20, 50, shared=[SYSTEM_A[:24]])
    reqs = with_tenants(
        [gen_req(f"rt{i}", p, max_new_tokens=48, priority=i % 3) for i, p in enumerate(prompts)]
    )
    results = run_in_waves(sched, reqs, first=8, steps_between=0)
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert_matches_oracle(reqs, results)


def test_priority_retraction_keeps_the_important_requests_running(monkeypatch):
    """Under memory pressure the low-priority requests are the ones retracted."""
    sched = make_scheduler(
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,
        retraction_policy="priority",
        enable_priority_scheduling=True,
    )
    prompts = random_prompts(12, 8, 20, 40)
    reqs = [
        gen_req(f"p{i}", p, max_new_tokens=32, priority=10 if i < 2 else 0) for i, p in enumerate(prompts)
    ]
    retracted = []
    original = ScheduleBatch.retract_decode

    def recording(batch, *args):
        out = original(batch, *args)
        retracted.extend(r.rid for r in out.retracted)
        return out

    monkeypatch.setattr(ScheduleBatch, "retract_decode", recording)
    results = run_in_waves(sched, reqs, first=8, steps_between=0)
    assert retracted and not {"p0", "p1"} & set(retracted)
    assert_matches_oracle(reqs, results)


def priority_burst(soft: bool, overlap: bool):
    """Two low-priority requests decode in a pool whose reservations leave no room for a burst
    of one much more important request: one of them is preempted. Returns the scheduler and the
    prompt tokens computed beyond each prompt once (the recomputed ones). Nothing was cached
    before: the KV a victim finds again when it comes back is its own, no cache hit."""
    sched = make_scheduler(
        enable_priority_scheduling=True,
        soft_priority_preemption=soft,
        overlap=overlap,
        max_total_tokens=200,
        init_new_token_ratio=1.0,
    )
    prompts = random_prompts(330, 3, 30, 40)
    low = [gen_req(f"low{i}", p, 32, priority=0, ignore_eos=True) for i, p in enumerate(prompts[:2])]
    vip = gen_req("vip", prompts[2], 32, priority=100, ignore_eos=True)
    sched.io.put(*low)
    for _ in range(16):  # the low ones decode about 15 tokens
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    sched.io.put(vip)
    sched.run_until_idle()
    assert sched.stats.num_preempted_reqs >= 1
    results = collect(sched.io.take_outputs())
    assert_matches_oracle([*low, vip], results)
    assert [results[r.rid].cached_tokens for r in (*low, vip)] == [0, 0, 0]
    assert sched.stats.num_cached_tokens == 0
    assert_no_leak(sched)
    return sched, sched.stats.num_prefill_tokens - sum(len(p) for p in prompts)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_soft_preemption_keeps_the_preempted_prefix(overlap):
    """The victim's prompt is in the radix cache either way (inserted after its prefill). Hard
    preemption frees the KV of its generated tokens, which it then recomputes; soft preemption
    hands that KV to the cache too, and here (the pool has the room: the preemption was for the
    reservations) the victim recomputes only its last token."""
    hard_sched, hard = priority_burst(soft=False, overlap=overlap)
    soft_sched, soft = priority_burst(soft=True, overlap=overlap)
    # Soft preemption evicts leaf tails (a victim keeps what an arrival does not take).
    assert soft_sched.tree_cache.evict_leaf_tails and not hard_sched.tree_cache.evict_leaf_tails
    assert hard >= 10
    assert soft <= 2 and soft <= hard // 2


def test_priority_arrival_takes_evictable_cache_before_preempting():
    """The pool's free tokens alone do not fit the important request, free + evictable do: it is
    admitted by evicting the cached prefix of a finished request, and nobody is preempted."""
    sched = make_scheduler(
        enable_priority_scheduling=True,
        soft_priority_preemption=True,
        max_total_tokens=200,
        init_new_token_ratio=1.0,
    )
    old, low_prompt, vip_prompt = random_prompts(332, 3, 35, 35)
    old = gen_req("old", old * 2 + old[:10], 8, ignore_eos=True)  # 80 tokens, cached when done
    sched.io.put(old)
    sched.run_until_idle()
    assert sched.tree_cache.evictable_size() >= 80
    low = gen_req("low", low_prompt, 32, priority=0, ignore_eos=True)
    vip = gen_req("vip", vip_prompt, 32, priority=100, ignore_eos=True)
    sched.io.put(low)
    for _ in range(3):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    # What the running request still reserves (ratio 1: all of its remaining max_new_tokens).
    free = sched.token_to_kv_pool_allocator.available_size() - sum(
        r.sampling_params.max_new_tokens - len(r.output_ids) for r in sched.running_batch.reqs
    )
    assert free < len(vip_prompt) + 32 <= free + sched.tree_cache.evictable_size()
    sched.io.put(vip)
    sched.run_until_idle()
    assert sched.stats.num_preempted_reqs == 0
    assert len(sched.tree_cache.match_prefix(old.input_ids).device_indices) < 79  # evicted for them
    assert_matches_oracle([low, vip], collect(sched.io.take_outputs()))
    assert_no_leak(sched)


def dlpm_counters_after(chunk: int, page_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """Tenant a sends one 96-token prompt, tenant b three 8-token ones (8 tokens of output each)
    under a 64-token quantum; the deficits and charged tokens once all are done."""
    sched = make_scheduler(
        schedule_policy="dlpm", dlpm_quantum_tokens=64, chunked_prefill_size=chunk, page_size=page_size
    )
    [long_prompt] = random_prompts(60, 1, 96, 96)
    reqs = [gen_req("a", long_prompt, 8, ignore_eos=True)]
    reqs += [gen_req(f"b{i}", p, 8, ignore_eos=True) for i, p in enumerate(random_prompts(61, 3, 8, 8))]
    for r in reqs:
        r.routing_key = r.rid[0]
    run_to_completion(sched, reqs)
    return sched.policy.fair.deficits, sched.policy.fair.served_tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_dlpm_charges_a_chunked_request_as_an_unchunked_one(page_size):
    """A request is charged its whole prompt and output budget when it is admitted, whatever
    --chunked-prefill-size: a's 104 tokens leave it 40 in debt after its quantum, b has 16 of
    its quantum left. Chunked, a used to be dropped from the deficits after its first chunk (it
    had nothing waiting while b's requests waited for its chunks), the rest uncharged."""
    unchunked = dlpm_counters_after(-1, page_size)
    assert unchunked == ({"a": -40, "b": 16}, {"a": 104, "b": 48})
    assert dlpm_counters_after(16, page_size) == unchunked


@pytest.mark.parametrize("chunk", [-1, 16])
@pytest.mark.parametrize("policy", ["slru", "lfu"])
def test_eviction_hits_count_distinct_requests(policy, chunk):
    """The scheduler inserts a prompt after its prefill (each chunk) and again when the request
    finishes: a prompt served once has one hit, and is not protected under slru; the one two
    requests shared has two."""
    sched = make_scheduler(radix_eviction_policy=policy, chunked_prefill_size=chunk)
    single, shared = random_prompts(70, 2, 40, 40)
    run_to_completion(sched, [gen_req("single", single, 8, ignore_eos=True)])
    run_to_completion(sched, [gen_req("s1", shared + [3], 8, ignore_eos=True)])
    run_to_completion(sched, [gen_req("s2", shared + [4], 8, ignore_eos=True)])
    hits = [sched.tree_cache.match_prefix(p).last_node.hit_count for p in (single, shared)]
    assert hits == [1, 2]
