"""Greedy outputs equal transformers', request by request, across every policy, radix cache on/off,
page sizes, chunk sizes, and a pool so small that decode retracts requests."""

from __future__ import annotations

import pytest
from sched_utils import (
    assert_matches_oracle,
    assert_no_leak,
    collect,
    gen_req,
    make_scheduler,
    random_prompts,
)

POLICIES = ["fcfs", "lpm", "dfs-weight", "lof", "random"]

SYSTEM_A = random_prompts(100, 1, 40, 40)[0]
SYSTEM_B = random_prompts(101, 1, 70, 70)[0]


def workload(tag: str) -> list:
    """Shared system prompts (40 and 70 tokens), unique tails, one long prompt that takes
    several chunks, mixed max_new_tokens."""
    prompts = random_prompts(7, 10, 3, 30, shared=[SYSTEM_A, SYSTEM_B]) + random_prompts(8, 2, 90, 110)
    return [gen_req(f"{tag}{i}", p, max_new_tokens=(16, 24, 8)[i % 3]) for i, p in enumerate(prompts)]


def run_in_waves(sched, reqs: list, first: int = 6, steps_between: int = 3):
    """Half the requests, a few steps (so the rest arrive while others decode), then the rest."""
    sched.io.put(*reqs[:first])
    for _ in range(steps_between):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    sched.io.put(*reqs[first:])
    sched.run_until_idle()
    assert_no_leak(sched)
    return collect(sched.io.take_outputs())


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("chunk", [16, 64, -1])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no_radix"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_matches_transformers(policy, radix, page_size, chunk, overlap):
    sched = make_scheduler(
        schedule_policy=policy,
        disable_radix_cache=not radix,
        page_size=page_size,
        chunked_prefill_size=chunk,
        overlap=overlap,
    )
    reqs = workload("eq")
    results = run_in_waves(sched, reqs)
    assert_matches_oracle(reqs, results)
    if radix:
        assert sched.stats.num_cached_tokens > 0
    # Every request streamed once per output token (its finishing step included).
    assert all(results[r.rid].num_messages == len(results[r.rid].output_ids) for r in reqs)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no_radix"])
@pytest.mark.parametrize("policy", POLICIES)
def test_retraction_keeps_tokens(policy, radix, page_size, overlap):
    sched = make_scheduler(
        overlap=overlap,
        schedule_policy=policy,
        disable_radix_cache=not radix,
        page_size=page_size,
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,  # an optimistic estimate: admits more than decode can hold
    )
    prompts = random_prompts(11, 8, 20, 50, shared=[SYSTEM_A[:24]])
    reqs = [gen_req(f"rt{i}", p, max_new_tokens=32) for i, p in enumerate(prompts)]
    results = run_in_waves(sched, reqs, first=8, steps_between=0)
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert_matches_oracle(reqs, results)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no_radix"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_mixed_chunk_matches_transformers(policy, radix, page_size, chunk, overlap):
    """--enable-mixed-chunk: prefill chunks carry the running requests' decode steps; the
    tokens are the same, and some batch really was mixed."""
    sched = make_scheduler(
        schedule_policy=policy,
        disable_radix_cache=not radix,
        page_size=page_size,
        chunked_prefill_size=chunk,
        enable_mixed_chunk=True,
        overlap=overlap,
    )
    mixed_steps = count_mixed_batches(sched)
    reqs = workload("mx")
    results = run_in_waves(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert mixed_steps() > 0
    assert all(results[r.rid].num_messages == len(results[r.rid].output_ids) for r in reqs)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_chunk_with_retraction_keeps_tokens(page_size, overlap):
    sched = make_scheduler(
        overlap=overlap,
        page_size=page_size,
        max_total_tokens=256,
        chunked_prefill_size=32,
        enable_mixed_chunk=True,
        init_new_token_ratio=0.05,
    )
    mixed_steps = count_mixed_batches(sched)
    prompts = random_prompts(11, 8, 20, 50, shared=[SYSTEM_A[:24]]) + random_prompts(12, 2, 60, 80)
    reqs = [gen_req(f"mr{i}", p, max_new_tokens=32) for i, p in enumerate(prompts)]
    results = run_in_waves(sched, reqs, first=4, steps_between=6)
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert mixed_steps() > 0
    assert_matches_oracle(reqs, results)


def count_mixed_batches(sched):
    """Wrap the scheduler's run_batch to count MIXED batches; returns the counter."""
    seen = []
    run_batch = sched.run_batch

    def counting_run_batch(batch):
        seen.append(batch.forward_mode.is_mixed())
        return run_batch(batch)

    sched.run_batch = counting_run_batch
    return lambda: sum(seen)
