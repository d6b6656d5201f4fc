"""The scheduler's messages to the detokenizer carry each output id (and its logprob) once: only
what is new since the request's previous message, in both loops and across retraction; the
first message of a request also carries the prompt's tail (the detokenizer's decode context)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from sched_utils import gen_req, make_scheduler, oracle_greedy, random_prompts

from radixengine.managers.io_struct import INIT_INCREMENTAL_DETOKENIZATION_OFFSET, BatchTokenIDOut


@dataclass
class Message:
    ids: list[int]
    logprobs: list[float] | None
    tail: list[int] | None
    finished: bool


def messages_by_rid(outputs: list[object]) -> dict[str, list[Message]]:
    by_rid: dict[str, list[Message]] = {}
    for msg in outputs:
        if not isinstance(msg, BatchTokenIDOut):
            continue
        assert len(set(msg.rids)) == len(msg.rids), "a request twice in one message"
        for i, rid in enumerate(msg.rids):
            m = Message(
                msg.output_ids[i],
                msg.output_token_logprobs[i] if msg.output_token_logprobs else None,
                msg.prompt_tail_ids[i],
                bool(msg.finished_reasons[i]),
            )
            by_rid.setdefault(rid, []).append(m)
    return by_rid


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_each_output_id_is_sent_once(overlap):
    sched = make_scheduler(overlap=overlap)
    prompts = random_prompts(500, 3, 5, 20)
    reqs = [gen_req(f"s{i}", p, max_new_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)]
    reqs[0].return_logprob = True
    sched.io.put(*reqs)
    sched.run_until_idle()
    by_rid = messages_by_rid(sched.io.take_outputs())
    for r in reqs:
        msgs = by_rid[r.rid]
        assert [len(m.ids) for m in msgs] == [1] * 24, "one new id per step, none sent twice"
        assert [t for m in msgs for t in m.ids] == oracle_greedy(r.input_ids, 24, True)
        assert [m.finished for m in msgs] == [False] * 23 + [True]
        logprobs = [m.logprobs for m in msgs]
        if r.return_logprob:
            assert [len(lp) for lp in logprobs] == [1] * 24 and all(lp[0] <= 0 for lp in logprobs)
        else:
            assert logprobs == [None] * 24


def test_first_message_carries_the_prompt_tail():
    sched = make_scheduler()
    short, long = [5, 6], random_prompts(501, 1, 20, 20)[0]
    sched.io.put(gen_req("short", short, 4), gen_req("long", long, 4), gen_req("bad", [], 4))
    sched.run_until_idle()
    by_rid = messages_by_rid(sched.io.take_outputs())
    for rid, prompt in (("short", short), ("long", long)):
        tails = [m.tail for m in by_rid[rid]]
        assert tails[0] == prompt[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:]
        assert tails[1:] == [None] * (len(tails) - 1)
    bad = by_rid["bad"]  # refused at once: one message, no ids, its (empty) tail
    assert len(bad) == 1 and bad[0].ids == [] and bad[0].tail == [] and bad[0].finished


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_retracted_requests_send_each_id_once(overlap):
    sched = make_scheduler(
        overlap=overlap,
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,  # an optimistic estimate: admits more than decode can hold
    )
    shared = random_prompts(100, 1, 40, 40)[0][:24]
    prompts = random_prompts(11, 8, 20, 50, shared=[shared])
    reqs = [gen_req(f"rt{i}", p, max_new_tokens=32) for i, p in enumerate(prompts)]
    sched.io.put(*reqs)
    sched.run_until_idle()
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    by_rid = messages_by_rid(sched.io.take_outputs())
    for r in reqs:
        msgs = by_rid[r.rid]
        expected = oracle_greedy(r.input_ids, 32)
        assert [t for m in msgs for t in m.ids] == expected
        assert all(len(m.ids) <= 1 for m in msgs)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_stream_interval_sends_the_first_token_at_once_then_every_n(overlap):
    """--stream-interval 4: a streaming request gets its first token at once, then 4 at a time,
    the rest when it finishes; a non-streaming one is unaffected; nothing is lost."""
    sched = make_scheduler(overlap=overlap, stream_interval=4)
    prompts = random_prompts(502, 2, 5, 20)
    streaming = replace(gen_req("st", prompts[0], max_new_tokens=10, ignore_eos=True), stream=True)
    plain = gen_req("pl", prompts[1], max_new_tokens=10, ignore_eos=True)
    sched.io.put(streaming, plain)
    sched.run_until_idle()
    by_rid = messages_by_rid(sched.io.take_outputs())
    assert [len(m.ids) for m in by_rid["st"]] == [1, 4, 4, 1]
    assert [m.finished for m in by_rid["st"]] == [False, False, False, True]
    assert [len(m.ids) for m in by_rid["pl"]] == [1] * 10
    for r in (streaming, plain):
        assert [t for m in by_rid[r.rid] for t in m.ids] == oracle_greedy(r.input_ids, 10, True)
