"""Admission as one plan: the PrefillPlan a round returns on hand-made queues (which requests, how
many tokens each, the chunked request, the preempted victims), that the plan leaves the requests
alone until the scheduler applies it, prefixes matched once per request per round, and
`batch_is_full` as computed from the rounds and the departures from the running batch."""

from __future__ import annotations

from sched_utils import (
    assert_matches_oracle,
    assert_no_leak,
    collect,
    gen_req,
    make_scheduler,
    random_prompts,
)


def queue(sched, reqs: list) -> None:
    sched.io.put(*reqs)
    sched.process_input_requests(sched.recv_requests())


def step(sched, n: int = 1) -> None:
    for _ in range(n):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()


def test_plan_chunks_the_request_that_does_not_fit_and_the_scheduler_applies_it():
    sched = make_scheduler(chunked_prefill_size=16)
    a, b, c = random_prompts(800, 3, 10, 10)
    b = b + random_prompts(801, 1, 20, 20)[0]  # 30 tokens
    reqs = [gen_req("a", a, 4), gen_req("b", b, 4), gen_req("c", c, 4)]
    queue(sched, reqs)
    plan = sched.admission.plan_prefill(sched.running_batch)
    assert [r.rid for r in plan.reqs] == ["a", "b"]
    assert plan.extend_lens == [10, 6]  # the chunk budget left after "a"
    assert plan.chunked_req is plan.reqs[1] and plan.preempted == [] and not plan.batch_is_full
    b_req = plan.reqs[1]
    assert b_req.extend_input_len == 30 and len(b_req.fill_ids) == 30  # untouched until applied

    batch = sched.apply_step_plan(sched.admission.apply_prefill_plan(plan, sched.running_batch))
    assert batch.extend_lens == [10, 6] and batch.input_ids.numel() == 16
    assert sched.chunked_req is b_req and b_req.fill_ids == b[:6] and b_req.is_chunked == 1
    assert [r.rid for r in sched.waiting_queue] == ["c"]
    # The plan's batch runs like any other: the three requests finish with the oracle's tokens.
    result = sched.run_batch(batch)
    sched.process_batch_result(batch, result)
    sched.last_batch = batch
    sched.run_until_idle()
    assert_no_leak(sched)
    assert_matches_oracle(reqs, collect(sched.io.take_outputs()))


def test_plan_names_the_preempted_victims():
    sched = make_scheduler(
        enable_priority_scheduling=True, max_total_tokens=160, init_new_token_ratio=1.0, overlap=False
    )
    low = [
        gen_req(f"low{i}", p, 40, priority=0, ignore_eos=True)
        for i, p in enumerate(random_prompts(802, 2, 20, 20))
    ]
    queue(sched, low)
    step(sched, 2)
    assert len(sched.running_batch.reqs) == 2
    vip = gen_req("vip", random_prompts(803, 1, 30, 30)[0], 40, priority=100, ignore_eos=True)
    queue(sched, [vip])
    plan = sched.admission.plan_prefill(sched.running_batch)
    assert [r.rid for r in plan.reqs] == ["vip"]
    assert plan.preempted and {r.rid for r in plan.preempted} <= {"low0", "low1"}
    assert all(r.is_retracted for r in plan.preempted)
    assert not any(r in sched.running_batch.reqs for r in plan.preempted)
    assert not any(r in sched.waiting_queue for r in plan.preempted)  # requeued when applied

    batch = sched.apply_step_plan(sched.admission.apply_prefill_plan(plan, sched.running_batch))
    assert batch is not None and [r.rid for r in batch.reqs] == ["vip"]
    assert all(r in sched.waiting_queue for r in plan.preempted)
    assert sched.stats.num_preempted_reqs == len(plan.preempted)
    result = sched.run_batch(batch)
    sched.process_batch_result(batch, result)
    sched.last_batch = batch
    sched.run_until_idle()
    assert_no_leak(sched)
    assert_matches_oracle([*low, vip], collect(sched.io.take_outputs()))


def test_each_waiting_request_is_matched_once_per_round():
    sched = make_scheduler(schedule_policy="lpm")
    shared = random_prompts(804, 1, 20, 20)[0]
    sched.io.put(gen_req("warm", shared + [3], 1))
    sched.run_until_idle()
    sched.io.take_outputs()
    calls: list[int] = []
    match_prefix = sched.tree_cache.match_prefix
    sched.tree_cache.match_prefix = lambda key, *rest: (calls.append(len(key)), match_prefix(key, *rest))[1]
    queue(sched, [gen_req(f"m{i}", shared[:n] + [99] * 3, 4) for i, n in enumerate([5, 12, 20])])
    plan = sched.admission.plan_prefill(sched.running_batch)
    assert len(calls) == 3  # LPM matches all three to order them; admission does not match again
    assert [r.rid for r in plan.reqs] == ["m2", "m1", "m0"]  # longest prefix first
    assert [len(r.prefix_indices) for r in plan.reqs] == [20, 12, 5]


def test_batch_is_full_holds_until_a_request_leaves():
    """Two rows, three requests: the round that admits two is full; no round admits anything
    while the two decode; the step after one finishes, the third is admitted."""
    sched = make_scheduler(max_running_requests=2)
    prompts = random_prompts(805, 3, 8, 8)
    lens = {"short": 3, "long": 12, "third": 4}
    reqs = [gen_req(rid, p, n, ignore_eos=True) for (rid, n), p in zip(lens.items(), prompts)]
    queue(sched, reqs)
    assert not sched.batch_is_full
    step(sched)  # prefill of two: the round stopped for want of rows
    assert [r.rid for r in sched.waiting_queue] == ["third"]
    assert not sched.batch_is_full  # nothing running yet: the prefill batch has not joined
    step(sched)  # it joins and decodes; the round does not even try
    assert sched.batch_is_full and len(sched.running_batch.reqs) == 2
    while not any(r.finished() for r in sched.running_batch.reqs):
        step(sched)
        assert sched.waiting_queue, "admitted before a row was free"
    step(sched)  # "short" leaves the running batch (after this step's round): a departure
    assert sched.waiting_queue and not sched.batch_is_full
    step(sched)  # so the next round looks again and admits "third"
    assert not sched.waiting_queue
    sched.run_until_idle()
    assert_no_leak(sched)
    assert_matches_oracle(reqs, collect(sched.io.take_outputs()))


def test_batch_is_full_is_never_set_under_priority_preemption():
    sched = make_scheduler(max_running_requests=2, enable_priority_scheduling=True)
    queue(sched, [gen_req(f"p{i}", p, 6, priority=0) for i, p in enumerate(random_prompts(806, 3, 8, 8))])
    step(sched, 2)
    assert len(sched.running_batch.reqs) == 2 and sched.waiting_queue
    assert not sched.batch_is_full  # preemption may make room every round
    sched.run_until_idle()
    assert_no_leak(sched)
