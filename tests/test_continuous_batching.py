"""Continuous batching under sustained load: freed slots are refilled at once, an over-admitting
round is retracted losslessly, decode keeps at least one request, and priority preemption
matches its prefix again after the preemption evicted it."""

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

from radixengine.managers.io_struct import BatchTokenIDOut


def finish_order(outputs: list[object]) -> list[str]:
    order = []
    for msg in outputs:
        if isinstance(msg, BatchTokenIDOut):
            order += [rid for rid, reason in zip(msg.rids, msg.finished_reasons) if reason is not None]
    return order


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_freed_slots_are_refilled_while_the_batch_runs(overlap):
    """max_running_requests=4, 12 requests alternating 4 and 40 new tokens (FCFS): each finished
    short request frees a row that the next waiting request takes at once, so the next short
    ones finish before the first long ones."""
    sched = make_scheduler(max_running_requests=4, overlap=overlap)
    prompts = random_prompts(700, 12, 6, 12)
    reqs = [gen_req(f"r{i}", p, 4 if i % 2 == 0 else 40, ignore_eos=True) for i, p in enumerate(prompts)]
    sched.io.put(*reqs)
    sched.run_until_idle()
    outputs = sched.io.take_outputs()
    order = finish_order(outputs)
    assert sorted(order) == sorted(r.rid for r in reqs)
    # Static batching finishes r1 and r3 (40 tokens) before r4 is even admitted.
    assert order.index("r4") < order.index("r1"), order
    assert order.index("r6") < order.index("r1"), order
    assert order[:4] == ["r0", "r2", "r4", "r6"], order
    assert_no_leak(sched)
    assert_matches_oracle(reqs, collect(outputs))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_over_admission_retracts_without_losing_tokens(overlap, page_size):
    """~450 tokens of demand through a 160-token pool: once the short requests finish, the next
    round over-admits (reserving only new_token_ratio of the running requests' remaining tokens)
    and decode retracts; every request still gets transformers' greedy tokens."""
    sched = make_scheduler(
        max_total_tokens=160, page_size=page_size, overlap=overlap, init_new_token_ratio=0.5
    )
    prompts = random_prompts(701, 12, 8, 8)
    reqs = [gen_req(f"q{i}", p, 4 if i % 2 == 0 else 44, ignore_eos=True) for i, p in enumerate(prompts)]
    results = run_to_completion(sched, reqs)
    assert sched.stats.num_retracted_reqs > 0, "demand exceeds the pool: decode must retract"
    assert_matches_oracle(reqs, results)


def start_decoding(sched, reqs: list, steps: int = 4) -> list:
    """Admit `reqs`, decode a few steps, then take every free KV slot away (after evicting the
    tree) so the next decode step finds no room. Returns the taken slots."""
    sched.io.put(*reqs)
    for _ in range(steps):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    assert len(sched.running_batch.reqs) == len(reqs)
    allocator = sched.token_to_kv_pool_allocator
    sched.tree_cache.evict(sched.tree_cache.evictable_size())
    return allocator.alloc(allocator.available_size())


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_retract_keeps_at_least_one_request(overlap):
    sched = make_scheduler(overlap=overlap)
    reqs = [gen_req(f"k{i}", p, 30, ignore_eos=True) for i, p in enumerate(random_prompts(702, 3, 10, 10))]
    stolen = start_decoding(sched, reqs)
    sched.run_step()
    assert 1 <= sched.stats.num_retracted_reqs <= 2
    assert not sched.running_batch.is_empty()
    assert sched.new_token_ratio > 0.0
    sched.token_to_kv_pool_allocator.free(stolen)
    sched.run_until_idle()
    assert_no_leak(sched)
    assert_matches_oracle(reqs, collect(sched.io.take_outputs()))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_last_request_that_cannot_fit_is_aborted_with_a_clear_error(overlap):
    """A single request with no room for its next token: aborted (500, "Out of memory"), not
    retracted into an empty batch with new_token_ratio 0; the scheduler goes on serving."""
    sched = make_scheduler(overlap=overlap)
    ratio = sched.new_token_ratio
    stolen = start_decoding(sched, [gen_req("only", random_prompts(705, 1, 10, 10)[0], 30, ignore_eos=True)])
    # (a whole step would self-check with slots taken)
    assert sched.apply_step_plan(sched.get_next_batch_to_run()) is None
    assert sched.stats.num_retracted_reqs == 0
    assert sched.new_token_ratio > 0.0 and sched.new_token_ratio <= ratio
    sched.token_to_kv_pool_allocator.free(stolen)
    after = gen_req("after", random_prompts(706, 1, 10, 10)[0], 8)
    sched.io.put(after)
    sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    reason = results["only"].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 500, reason
    assert "Out of memory" in reason["message"]
    assert_no_leak(sched)
    assert_matches_oracle([after], results)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_preemption_that_evicts_the_matched_prefix_does_not_kill_the_scheduler(overlap, policy):
    """The VIP request matched a cached prefix; preempting a running request evicts it (the
    release makes room for the remaining requests' next `retract_decode_steps` steps, evicting
    the tree). It must be matched again before it is admitted."""
    sched = make_scheduler(
        enable_priority_scheduling=True,
        max_total_tokens=160,
        init_new_token_ratio=1.0,
        retract_decode_steps=200,
        schedule_policy=policy,
        overlap=overlap,
    )
    shared = random_prompts(703, 1, 40, 40)[0]
    run_to_completion(sched, [gen_req("warm", shared + [3], 1)])
    assert sched.tree_cache.evictable_size() >= 40
    low = [
        gen_req(f"low{i}", p, 40, priority=0, ignore_eos=True)
        for i, p in enumerate(random_prompts(704, 2, 20, 20))
    ]
    sched.io.put(*low)
    for _ in range(3):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    vip = gen_req("vip", shared + [9, 11], 60, priority=100, ignore_eos=True)
    sched.io.put(vip)
    sched.run_until_idle()
    assert sched.stats.num_preempted_reqs >= 1
    results = collect(sched.io.take_outputs())
    assert_no_leak(sched)
    assert_matches_oracle([*low, vip], results)
