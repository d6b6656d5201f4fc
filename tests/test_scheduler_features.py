"""Scheduler behaviour beyond token equivalence: in-batch prefix caching, cached_tokens, aborts,
bad requests, priority preemption, stop conditions, flush / state messages, the event loop and
the idle self-check."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from sched_utils import (
    EOS,
    assert_matches_oracle,
    assert_no_leak,
    collect,
    gen_req,
    make_scheduler,
    oracle_greedy,
    oracle_greedy_min_new_tokens,
    random_prompts,
    run_to_completion,
)
from test_scheduler_equivalence import SYSTEM_A

from radixengine.managers.io_struct import (
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from radixengine.managers.schedule_batch import Req
from radixengine.mem_cache.accounting import TokenAccountingError
from radixengine.sampling.sampling_params import SamplingParams

POLICIES = ["fcfs", "lpm", "dfs-weight", "lof", "random"]
SYSTEM = random_prompts(300, 1, 64, 64)[0]


def step(sched, n: int = 1) -> None:
    for _ in range(n):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()


# In-batch prefix caching and cached_tokens -------------------------------------------------------


@pytest.mark.parametrize("chunk", [-1, 16])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_shared_system_prompt_is_computed_once(policy, chunk, overlap):
    """32 requests sharing a 64-token system prompt, submitted at once: the prompt is prefilled
    once, whatever the policy; the others wait one round and hit the cache."""
    tails = [[100 + i] + t for i, t in enumerate(random_prompts(301, 32, 7, 7))]  # distinct tails
    reqs = [gen_req(f"s{i}", SYSTEM + t, max_new_tokens=4) for i, t in enumerate(tails)]
    sched = make_scheduler(schedule_policy=policy, chunked_prefill_size=chunk, overlap=overlap)
    results = run_to_completion(sched, reqs)
    assert sched.stats.num_prefill_tokens == 64 + 32 * 8
    assert sorted(results[r.rid].cached_tokens for r in reqs) == [0] + [64] * 31

    off = make_scheduler(
        schedule_policy=policy,
        chunked_prefill_size=chunk,
        disable_in_batch_prefix_caching=True,
        overlap=overlap,
    )
    run_to_completion(off, reqs)
    if chunk == -1:  # one batch, each request computes the prompt itself
        assert off.stats.num_prefill_tokens == 32 * 72


def test_cached_tokens_per_request():
    for page_size, expected in ((1, 64), (16, 64)):
        sched = make_scheduler(page_size=page_size)
        first = run_to_completion(sched, [gen_req("a", SYSTEM + [11, 12, 13], 4)])
        second = run_to_completion(sched, [gen_req("b", SYSTEM + [21, 22], 4)])
        assert first["a"].cached_tokens == 0 and first["a"].prompt_tokens == 67
        assert second["b"].cached_tokens == expected
    # page 16: a 40-token shared prefix caches 32 (whole pages)
    sched = make_scheduler(page_size=16)
    run_to_completion(sched, [gen_req("c", SYSTEM[:40] + [11, 12], 4)])
    assert run_to_completion(sched, [gen_req("d", SYSTEM[:40] + [21], 4)])["d"].cached_tokens == 32
    # the same prompt again: everything but the last token comes from the cache
    sched = make_scheduler()
    run_to_completion(sched, [gen_req("e", SYSTEM, 4)])
    assert run_to_completion(sched, [gen_req("f", SYSTEM, 4)])["f"].cached_tokens == 63


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_tokens_count_once_after_retraction(page_size, overlap):
    """A retracted request matches its own prompt (cached after its prefill) when it comes back:
    not a cache hit (SGLang counts a request's hits before its first retraction only). Each
    request's cached_tokens, and the scheduler's total, equal those of a pool that retracts
    nothing: the shared 24-token prefix (whole pages of it), and none for the first request."""
    prompts = random_prompts(11, 8, 20, 50, shared=[SYSTEM_A[:24]])
    reqs = [gen_req(f"rt{i}", p, max_new_tokens=32) for i, p in enumerate(prompts)]
    tight = make_scheduler(
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,
        page_size=page_size,
        overlap=overlap,
    )
    retracted = run_to_completion(tight, reqs)
    assert tight.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    roomy = make_scheduler(chunked_prefill_size=64, page_size=page_size, overlap=overlap)
    expected = run_to_completion(roomy, reqs)
    assert roomy.stats.num_retracted_reqs == 0
    hits = [retracted[r.rid].cached_tokens for r in reqs]
    assert hits == [expected[r.rid].cached_tokens for r in reqs] == [0] + [24 // page_size * page_size] * 7
    assert tight.stats.num_cached_tokens == roomy.stats.num_cached_tokens == sum(hits)
    assert all(retracted[r.rid].cached_tokens <= retracted[r.rid].prompt_tokens for r in reqs)


# Aborts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_abort_mid_decode_frees_everything(radix, overlap):
    prompts = random_prompts(310, 3, 10, 30)
    reqs = [gen_req(f"a{i}", p, max_new_tokens=40, ignore_eos=True) for i, p in enumerate(prompts)]
    sched = make_scheduler(disable_radix_cache=not radix, overlap=overlap)
    sched.io.put(*reqs)
    step(sched, 6)
    sched.io.put(AbortReq("a1"), AbortReq("no-such-request"))
    sched.run_until_idle()
    assert_no_leak(sched)
    results = collect(sched.io.take_outputs())
    aborted = results["a1"]
    assert aborted.finished_reason["type"] == "abort"
    assert 0 < len(aborted.output_ids) < 40
    assert aborted.output_ids == oracle_greedy(prompts[1], 40, True)[: len(aborted.output_ids)]
    others = [reqs[0], reqs[2]]
    assert_matches_oracle(others, results)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_abort_waiting_and_chunked_requests(overlap):
    long_prompt = random_prompts(311, 1, 120, 120)[0]
    sched = make_scheduler(chunked_prefill_size=16, max_running_requests=2, overlap=overlap)
    reqs = [
        gen_req("chunked", long_prompt, 8),
        gen_req("w1", [5, 6, 8], 8),
        gen_req("w2", [9, 10, 11], 8),
        gen_req("w3", [12, 13, 14], 8),
    ]
    sched.io.put(*reqs)
    step(sched, 2)  # two chunks of the long prompt
    assert sched.chunked_req is not None and sched.chunked_req.rid == "chunked"
    sched.io.put(AbortReq("chunked"), AbortReq("w3"))
    sched.run_until_idle()
    assert_no_leak(sched)
    results = collect(sched.io.take_outputs())
    assert results["chunked"].finished_reason["type"] == "abort"
    assert results["chunked"].output_ids == []
    assert results["w3"].finished_reason["type"] == "abort"
    assert_matches_oracle(reqs[1:3], results)


# Bad requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_bad_requests_finish_at_once_while_others_finish(overlap):
    sched = make_scheduler(max_queued_requests=4, overlap=overlap)
    ctx = sched.max_req_len
    good = [gen_req(f"ok{i}", p, 8) for i, p in enumerate(random_prompts(320, 2, 5, 20))]
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_new_tokens": 8, "temprature": 0.5})
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams.from_dict({"max_new_tokens": -1})
    # the front end turns those into a request with `error` set
    front_end_error = TokenizedGenerateReqInput(
        rid="unknown-field",
        input_text=None,
        input_ids=[5, 6],
        sampling_params=SamplingParams(),
        error="unknown sampling parameter(s): temprature",
    )
    bad = [
        gen_req("empty", [], 8),
        gen_req("too-long", [5] * (ctx + 10), 8),
        gen_req("too-many-new", [5, 6, 8], ctx),
        gen_req("bad-token", [5, 999], 8),
        front_end_error,
    ]
    negative = gen_req("negative", [5, 6], 8)
    negative.sampling_params.max_new_tokens = -3  # mutated after validation
    overflow = [gen_req(f"q{i}", [20 + i, 30], 8) for i in range(3)]
    sched.io.put(*good, *bad, negative, *overflow)
    step(sched)
    first = collect(sched.io.outputs)
    for r in [*bad, negative]:
        reason = first[r.rid].finished_reason
        assert reason["type"] == "abort" and reason["status_code"] == 400, r.rid
        assert first[r.rid].output_ids == []
    assert "empty" in first["empty"].finished_reason["message"]
    assert "context length" in first["too-long"].finished_reason["message"]
    assert "maximum context length" in first["too-many-new"].finished_reason["message"]
    assert "temprature" in first["unknown-field"].finished_reason["message"]
    assert "max_new_tokens" in first["negative"].finished_reason["message"]
    # queue of 4: ok0, ok1, q0, q1 queued; q2 rejected with 503
    assert first["q2"].finished_reason["status_code"] == 503
    assert "queue is full" in first["q2"].finished_reason["message"]
    sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    assert_matches_oracle([*good, *overflow[:2]], results)
    assert sched.stats.num_prefill_tokens == sum(len(r.input_ids) for r in [*good, *overflow[:2]])


def test_full_queue_with_priorities_evicts_the_worst():
    sched = make_scheduler(max_queued_requests=2, enable_priority_scheduling=True)
    low = gen_req("low", [5, 6, 8], 4, priority=1)
    mid = gen_req("mid", [9, 10], 4, priority=5)
    high = gen_req("high", [11, 12], 4, priority=9)
    lower = gen_req("lower", [13, 14], 4, priority=0)
    sched.process_input_requests([low, mid, high, lower])
    results = collect([])
    sched.streamer.stream_output()
    results = collect(sched.io.outputs)
    assert results["low"].finished_reason["message"] == "The request is aborted by a higher priority request."
    assert results["lower"].finished_reason["message"] == "The request queue is full."
    assert [r.rid for r in sched.waiting_queue] == ["mid", "high"]
    sched.run_until_idle()


# Priority preemption -----------------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["running", "memory"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_priority_preemption(limit, overlap):
    """A much more important request preempts a running one (back to the queue, later finishing
    with the same tokens)."""
    overrides = dict(enable_priority_scheduling=True, overlap=overlap)
    if limit == "running":
        overrides.update(max_running_requests=2)
    else:
        overrides.update(max_total_tokens=200, init_new_token_ratio=1.0)
    sched = make_scheduler(**overrides)
    prompts = random_prompts(330, 3, 30, 40)
    low = [gen_req(f"low{i}", p, 32, priority=0, ignore_eos=True) for i, p in enumerate(prompts[:2])]
    vip = gen_req("vip", prompts[2], 32, priority=100, ignore_eos=True)
    sched.io.put(*low)
    step(sched, 4)
    assert len(sched.running_batch.reqs) == 2
    sched.io.put(vip)
    step(sched)
    assert sched.stats.num_preempted_reqs >= 1
    assert any(r.is_retracted for r in sched.waiting_queue)
    assert "vip" in [r.rid for r in sched.running_batch.reqs] + [r.rid for r in sched.last_batch.reqs]
    sched.run_until_idle()
    assert_no_leak(sched)
    assert_matches_oracle([*low, vip], collect(sched.io.take_outputs()))


def test_no_preemption_within_threshold():
    sched = make_scheduler(enable_priority_scheduling=True, max_running_requests=2)
    low = [gen_req(f"l{i}", p, 16, priority=0) for i, p in enumerate(random_prompts(331, 2, 10, 20))]
    sched.io.put(*low)
    step(sched, 2)
    sched.io.put(gen_req("near", [5, 6, 8], 4, priority=10))  # diff 10 is not > 10
    step(sched)
    assert sched.stats.num_preempted_reqs == 0
    sched.run_until_idle()


# Stop conditions ---------------------------------------------------------------------------------


class CharTokenizer:
    """Token t decodes to one letter (enough for stop strings)."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_stop_token_ids_strings_and_min_new_tokens(overlap):
    prompt = random_prompts(340, 1, 12, 12)[0]
    full = oracle_greedy(prompt, 24)
    assert EOS not in full
    stop_tok = full[5]
    first = full.index(stop_tok)
    later = [i for i, t in enumerate(full) if t == stop_tok]
    text = CharTokenizer.decode(full)
    stop_str = text[7:10]
    reqs = [
        gen_req("tok", prompt, 24, stop_token_ids=[stop_tok]),
        gen_req("str", prompt, 24, stop=[stop_str, "zzzzzzzz"]),
        gen_req("min", prompt, 24, stop_token_ids=[full[1]], min_new_tokens=10),
        gen_req("len", prompt, 24),
    ]
    results = run_to_completion(make_scheduler(), reqs)  # no tokenizer: stop strings unchecked
    assert results["str"].output_ids == full
    results = run_to_completion(make_scheduler(tokenizer=CharTokenizer(), overlap=overlap), reqs)
    assert results["tok"].output_ids == full[: first + 1]
    assert results["tok"].finished_reason == {"type": "stop", "matched": stop_tok}
    end = text.index(stop_str) + len(stop_str)
    assert results["str"].output_ids == full[:end]
    assert results["str"].finished_reason == {"type": "stop", "matched": stop_str}
    # min_new_tokens keeps the stop token (and EOS) from being sampled before the minimum.
    assert results["min"].output_ids == oracle_greedy_min_new_tokens(prompt, 24, 10, [full[1], EOS])
    assert results["len"].finished_reason == {"type": "length", "length": 24}
    assert later  # sanity


def test_check_finished_order_and_eos():
    def req(**params) -> Req:
        r = Req("r", None, [1, 2], SamplingParams(max_new_tokens=5, **params))
        return r

    eos = frozenset({EOS})
    r = req()
    r.output_ids = [3, EOS]
    r.check_finished(eos)
    assert r.finished_reason == {"type": "stop", "matched": EOS}
    r = req(ignore_eos=True)
    r.output_ids = [3, EOS]
    r.check_finished(eos)
    assert r.finished_reason is None
    r = req(ignore_eos=True, stop_token_ids=[4])
    r.output_ids = [3, 4]
    r.check_finished(eos)
    assert r.finished_reason is None  # ignore_eos turns off every token-based stop
    r = req(stop_token_ids=[4])
    r.output_ids = [3, 4]
    r.check_finished(eos)
    assert r.finished_reason == {"type": "stop", "matched": 4}
    r = req()
    r.output_ids = [3, 4, 5, 6, EOS]
    r.check_finished(eos)
    assert r.finished_reason == {"type": "length", "length": 5}  # length is checked first
    r = req()
    r.to_abort = True
    r.check_finished(eos)
    assert r.finished_reason["type"] == "abort"


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_eos_and_ignore_eos_end_to_end(overlap):
    """The worker's EOS ids stop a request unless ignore_eos (EOS set here to a token the greedy
    continuation reaches: the random model rarely picks its configured one)."""
    prompt = random_prompts(341, 1, 10, 10)[0]
    cont = oracle_greedy(prompt, 24, ignore_eos=True)
    eos = cont[6]
    sched = make_scheduler(overlap=overlap, eos_token_ids=frozenset({eos}))
    reqs = [gen_req("eos", prompt, 24), gen_req("ignore", prompt, 24, ignore_eos=True)]
    results = run_to_completion(sched, reqs)
    assert results["eos"].output_ids == cont[: cont.index(eos) + 1]
    assert results["eos"].finished_reason == {"type": "stop", "matched": eos}
    assert results["ignore"].output_ids == cont
    assert results["ignore"].finished_reason == {"type": "length", "length": 24}


# Messages, loop, self-check ----------------------------------------------------------------------


def test_flush_cache_and_internal_state_messages():
    sched = make_scheduler()
    run_to_completion(sched, [gen_req("x", SYSTEM, 4)])
    assert sched.tree_cache.evictable_size() > 0
    sched.io.put(gen_req("y", SYSTEM[:20], 30), GetInternalStateReq())
    step(sched)
    sched.io.put(FlushCacheReqInput())
    step(sched)
    replies = [m for m in sched.io.take_outputs() if not hasattr(m, "rids")]
    state = next(m for m in replies if isinstance(m, GetInternalStateReqOutput)).state
    for key in (
        "num_running_reqs",
        "num_queue_reqs",
        "num_retracted_reqs",
        "num_preempted_reqs",
        "num_prefill_tokens",
        "num_cached_tokens",
        "num_generated_tokens",
        "max_total_tokens",
        "available_tokens",
        "evictable_tokens",
        "protected_tokens",
        "token_usage",
        "cache_hit_rate",
        "new_token_ratio",
    ):
        assert key in state
    # answered after the step: "y" was admitted by then
    assert state["num_queue_reqs"] == 0 and state["num_running_reqs"] == 1
    assert state["max_total_tokens"] == 4096
    flush = next(m for m in replies if isinstance(m, FlushCacheReqOutput))
    assert flush.success is False  # "y" is running
    sched.run_until_idle()
    assert sched.flush_cache()
    assert sched.tree_cache.evictable_size() == 0
    assert sched.token_to_kv_pool_allocator.available_size() == 4096
    state = sched.get_internal_state()
    assert state["cache_hit_rate"] > 0 and state["num_generated_tokens"] == 34


def test_event_loop_normal_in_a_thread():
    sched = make_scheduler()
    reqs = [gen_req(f"t{i}", p, 8) for i, p in enumerate(random_prompts(350, 4, 5, 15))]
    results, thread = run_normal_loop_in_a_thread(sched, reqs)
    assert not thread.is_alive()
    assert_matches_oracle(reqs, results)


def run_normal_loop_in_a_thread(sched, reqs: list):
    """`event_loop_normal` on a thread until every request finished (or 60 s), then the I/O closed:
    the results and the thread."""
    thread = threading.Thread(target=sched.event_loop_normal, daemon=True)
    thread.start()
    sched.io.put(*reqs)
    deadline = time.monotonic() + 60
    results = {}
    while time.monotonic() < deadline and thread.is_alive():
        with sched.io._cond:
            results = collect(list(sched.io.outputs))
        if len(results) == len(reqs) and all(r.finished_reason for r in results.values()):
            break
        time.sleep(0.02)
    sched.io.close()
    thread.join(10)
    return results, thread


def test_self_check_raises_in_test_mode_and_logs_otherwise(caplog):
    sched = make_scheduler()
    leaked = sched.token_to_kv_pool_allocator.alloc(3)
    with pytest.raises(TokenAccountingError, match="3 tokens leaked"):
        sched.self_check_during_idle()
    quiet = make_scheduler(test_mode=False)
    quiet.token_to_kv_pool_allocator.alloc(2)
    with caplog.at_level(logging.ERROR):
        quiet.self_check_during_idle()
    assert "2 tokens leaked" in caplog.text
    assert leaked is not None


def test_outputs_report_queue_times():
    sched = make_scheduler(max_running_requests=1)
    sched.io.put(gen_req("first", [5, 6, 8], 4), gen_req("second", [9, 10], 4), gen_req("bad", [], 4))
    sched.run_until_idle()
    latest = {}
    for msg in sched.io.take_outputs():
        for rid, q in zip(msg.rids, msg.queue_times):
            latest[rid] = q
    assert latest["bad"] is None
    assert 0 <= latest["first"] < latest["second"]  # "second" waited for the only running slot


def test_event_loop_normal_runs_normal_steps_on_an_overlap_scheduler():
    """The loop a caller names is the loop that runs: `event_loop_normal` never takes an overlap
    step, and `event_loop_overlap` refuses a scheduler built without the overlapped client."""
    sched = make_scheduler(overlap=True)
    assert sched.enable_overlap

    def no_overlap_step():
        raise AssertionError("event_loop_normal ran an overlap step")

    sched.run_step_overlap = no_overlap_step
    reqs = [gen_req(f"n{i}", p, 6) for i, p in enumerate(random_prompts(351, 3, 5, 12))]
    results, _ = run_normal_loop_in_a_thread(sched, reqs)
    sched.close()
    assert_matches_oracle(reqs, results)
    assert_no_leak(sched)
    with pytest.raises(RuntimeError, match="event_loop_overlap"):
        make_scheduler(overlap=False).event_loop_overlap()
