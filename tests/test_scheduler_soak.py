"""A randomized soak: a few hundred requests of random lengths with shared prefixes, staggered
arrivals, aborts and priorities through a small pool, for every policy. Every request finishes
with the tokens of an unconstrained reference run (aborted ones with a prefix of them), and no
KV slot or request row leaks."""

from __future__ import annotations

import random
from functools import cache

import pytest
from sched_utils import assert_no_leak, collect, gen_req, make_scheduler, random_prompts

from radixengine.managers.io_struct import AbortReq

POLICIES = ["fcfs", "lpm", "dfs-weight", "lof", "random"]
NUM_REQS = 200


@cache
def soak_requests() -> tuple:
    rng = random.Random(2024)
    systems = [random_prompts(500 + i, 1, 10, 50)[0] for i in range(4)]
    reqs = []
    for i in range(NUM_REQS):
        tail = random_prompts(600 + i, 1, 1, 40)[0]
        prefix = rng.choice(systems) if rng.random() < 0.8 else []
        reqs.append(gen_req(f"k{i}", prefix + tail, max_new_tokens=rng.randint(1, 24), priority=rng.randint(0, 30)))
    return tuple(reqs)


@cache
def reference_outputs() -> dict[str, list[int]]:
    sched = make_scheduler(max_total_tokens=16384, max_running_requests=256)
    sched.io.put(*soak_requests())
    sched.run_until_idle()
    return {rid: r.output_ids for rid, r in collect(sched.io.take_outputs()).items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("priority", [False, True], ids=["fifo", "priority"])
@pytest.mark.parametrize("policy", POLICIES)
def test_randomized_soak(policy, priority, overlap):
    seed = POLICIES.index(policy) * 2 + priority
    rng = random.Random(seed)
    sched = make_scheduler(
        schedule_policy=policy,
        page_size=(1, 16)[seed % 2],
        max_total_tokens=512,
        chunked_prefill_size=32,
        max_prefill_tokens=256,
        enable_priority_scheduling=priority,
        max_running_requests=16 if priority else None,
        init_new_token_ratio=0.1,  # optimistic admission: decode runs short and retracts
        overlap=overlap,
    )
    reqs = list(soak_requests())
    aborts: dict[int, list[str]] = {}
    steps = 0
    while reqs or not sched.is_idle():
        for _ in range(min(len(reqs), rng.choice([0, 0, 1, 2, 4, 8]))):
            req = reqs.pop(0)
            sched.io.put(req)
            if rng.random() < 0.1:
                aborts.setdefault(steps + rng.randint(0, 30), []).append(req.rid)
        sched.io.put(*(AbortReq(rid) for rid in aborts.pop(steps, [])))
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()  # test mode: the idle self-check raises on any leak
        steps += 1
        assert steps < 20_000
    assert_no_leak(sched)

    reference = reference_outputs()
    results = collect(sched.io.take_outputs())
    assert len(results) == NUM_REQS
    for rid, res in results.items():
        assert res.finished_reason is not None, rid
        if res.finished_reason["type"] == "abort":
            assert res.output_ids == reference[rid][: len(res.output_ids)], rid
        else:
            assert res.output_ids == reference[rid], rid
    assert sum(r.finished_reason["type"] == "abort" for r in results.values()) > 5
    assert sched.stats.num_retracted_reqs + sched.stats.num_preempted_reqs > 0
