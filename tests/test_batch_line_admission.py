"""Batch lines (`interactive=False`: the lines of /v1/batches) yield to interactive requests,
whatever the policy and the priority flag: an interactive request that arrives while batch lines
wait is admitted before them (even against a priority the batch line asked for), no batch line
is admitted in a round that leaves an interactive request waiting, and decode retracts batch
lines first. The scheduler runs in-process (tests/sched_utils.py); the outputs match
transformers and the token accounting holds at the end."""

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

from radixengine.managers.req import Req
from radixengine.managers.retraction_policy import retraction_order
from radixengine.sampling.sampling_params import SamplingParams


def step(sched) -> set[str]:
    """One scheduler step; returns the rids still waiting after it."""
    sched.process_input_requests(sched.recv_requests())
    sched.run_step()
    return {r.rid for r in sched.waiting_queue}


@pytest.mark.parametrize("priority_scheduling", [False, True], ids=["no-priority", "priority"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm", "lof"])
def test_an_interactive_request_goes_before_waiting_batch_lines(policy, priority_scheduling):
    sched = make_scheduler(
        max_running_requests=2, schedule_policy=policy, enable_priority_scheduling=priority_scheduling
    )
    prompts = random_prompts(901, 5, 8, 16)
    # The batch lines ask for a high priority and more tokens (lof's first): neither counts.
    lines = [
        gen_req(f"b{i}", p, 6, priority=1000, interactive=False, ignore_eos=True)
        for i, p in enumerate(prompts[:4])
    ]
    sched.io.put(*lines)
    assert step(sched) == {"b2", "b3"}  # two rows: two lines run, two wait
    chat = gen_req("chat", prompts[4], 3, ignore_eos=True)
    sched.io.put(chat)
    waiting = step(sched)
    while "chat" in waiting:
        assert waiting >= {"b2", "b3"}, "a batch line was admitted before the interactive request"
        waiting = step(sched)
    assert {"b2", "b3"} & waiting, "the interactive request was admitted with the batch lines, not before"
    sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    assert_no_leak(sched)
    assert_matches_oracle([*lines, chat], results)


def test_no_batch_line_is_admitted_while_an_interactive_request_waits():
    """Two interactive requests share a long uncached prefix: the second waits a round for the
    first to compute it (in-batch prefix caching). The batch line behind them, which would fit,
    waits too."""
    sched = make_scheduler()
    shared, tails = random_prompts(902, 1, 40, 40)[0], random_prompts(903, 3, 4, 8)
    line = gen_req("line", tails[0], 4, interactive=False)
    first, second = (gen_req(f"chat{i}", shared + t, 4) for i, t in enumerate(tails[1:]))
    sched.io.put(line, first, second)
    assert step(sched) == {"chat1", "line"}
    assert step(sched) == set()  # then both
    sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    assert_no_leak(sched)
    assert_matches_oracle([line, first, second], results)


@pytest.mark.parametrize("policy", ["length", "priority"])
def test_decode_retracts_batch_lines_first(policy):
    def req(rid: str, outputs: int, interactive: bool, priority: int | None = None) -> Req:
        r = Req(
            rid, None, [5] * 10, SamplingParams(max_new_tokens=64), priority=priority, interactive=interactive
        )
        r.output_ids = [9] * outputs
        return r

    # By length alone, the interactive request with the fewest outputs would go first; by
    # priority, the one without a priority.
    reqs = [req("line-long", 40, False, 5), req("chat-short", 1, True), req("line-short", 2, False, 5)]
    order = [reqs[i].rid for i in retraction_order(reqs, policy)]
    assert order[-2:] == ["line-long", "line-short"]  # popped from the end: the lines first
