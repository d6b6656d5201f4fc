"""A randomized soak that mixes everything at once: a few hundred requests of random lengths with
shared prefixes, staggered arrivals, aborts (a client that disconnects), priorities with
preemption, stop strings, stop token ids, min_new_tokens and ignore_eos, chunked prefill (mixed
with decode or not) and retraction from a small pool, both loops, every policy. Every request
finishes with the tokens of an unconstrained reference run (aborted ones with a prefix of them),
the scheduler never dies, and no KV slot or request row leaks."""

from __future__ import annotations

import random
from functools import cache

import pytest
from sched_utils import assert_no_leak, collect, gen_req, make_scheduler, random_prompts

from radixengine.managers.io_struct import AbortReq

POLICIES = ["fcfs", "lpm", "dfs-weight", "lof", "random"]
NUM_REQS = 200


class LetterTokenizer:
    """Token t decodes to one letter (enough for stop strings)."""

    eos_token_id = None

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def stop_conditions(rng: random.Random, max_new: int) -> dict:
    """Random stop conditions: stop strings, stop token ids, min_new_tokens, ignore_eos."""
    params: dict = {}
    if rng.random() < 0.2:
        params["stop"] = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 2)))]
    if rng.random() < 0.2:
        params["stop_token_ids"] = [rng.randrange(2, 256) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        params["min_new_tokens"] = rng.randint(1, max_new)
    if rng.random() < 0.1:
        params["ignore_eos"] = True
    return params


@cache
def soak_requests() -> tuple:
    rng = random.Random(2024)
    systems = [random_prompts(500 + i, 1, 10, 50)[0] for i in range(4)]
    reqs = []
    for i in range(NUM_REQS):
        tail = random_prompts(600 + i, 1, 1, 40)[0]
        prefix = rng.choice(systems) if rng.random() < 0.8 else []
        max_new = rng.randint(1, 24)
        params = stop_conditions(rng, max_new)
        reqs.append(
            gen_req(f"k{i}", prefix + tail, max_new_tokens=max_new, priority=rng.randint(0, 30), **params)
        )
    return tuple(reqs)


@cache
def reference_outputs() -> dict[str, list[int]]:
    sched = make_scheduler(tokenizer=LetterTokenizer(), max_total_tokens=16384, max_running_requests=256)
    sched.io.put(*soak_requests())
    sched.run_until_idle()
    return {rid: r.output_ids for rid, r in collect(sched.io.take_outputs()).items()}


@pytest.mark.parametrize("mixed", [False, True], ids=["", "mixed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("priority", [False, True], ids=["fifo", "priority"])
@pytest.mark.parametrize("policy", POLICIES)
def test_randomized_soak(policy, priority, overlap, mixed):
    seed = POLICIES.index(policy) * 2 + priority
    rng = random.Random(seed)
    sched = make_scheduler(
        tokenizer=LetterTokenizer(),
        enable_mixed_chunk=mixed,
        schedule_policy=policy,
        page_size=(1, 16)[seed % 2],
        max_total_tokens=320 if mixed else 512,  # mixed steps decode more often: less pressure
        chunked_prefill_size=32,
        max_prefill_tokens=256,
        enable_priority_scheduling=priority,
        max_running_requests=16 if priority else None,
        init_new_token_ratio=0.02,  # optimistic admission: decode runs short and retracts
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
    matched = [r.finished_reason.get("matched") for r in results.values()]
    assert any(isinstance(m, str) for m in matched) and any(isinstance(m, int) for m in matched)
    assert sched.stats.num_retracted_reqs + sched.stats.num_preempted_reqs > 0
