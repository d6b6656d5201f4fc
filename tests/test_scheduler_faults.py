"""A request whose logits are all NaN fails alone: it is aborted with a clear error, the other
requests of the batch finish with their greedy tokens, and the scheduler keeps serving."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from sched_utils import (
    EOS,
    assert_matches_oracle,
    collect,
    gen_req,
    make_scheduler,
    oracle_greedy,
    random_prompts,
)


@contextmanager
def nan_embedding(sched, token: int):
    """The model's input embedding of `token` set to NaN (restored after): every position from
    that token on computes NaN hidden states, so the request's logits are all NaN."""
    weight = sched.tp_worker.model_runner.model.model.embed_tokens.weight
    saved = weight[token].clone()
    with torch.no_grad():
        weight[token] = float("nan")
    try:
        yield
    finally:
        with torch.no_grad():
            weight[token] = saved


def pick_poison_token() -> tuple[int, list[int], list[list[int]]]:
    """A token the greedy continuation of one prompt reaches at its third step, and prompts whose
    prompt and continuation never contain it."""
    dec_prompt = random_prompts(980, 1, 10, 10)[0]
    cont = oracle_greedy(dec_prompt, 12)
    poison = cont[2]
    assert poison not in dec_prompt and poison not in cont[:2]
    clean = [p for p in random_prompts(981, 12, 8, 16) if poison not in p + oracle_greedy(p, 12)]
    return poison, dec_prompt, clean[:3]


@pytest.mark.parametrize(
    "overlap,sync_free",
    [(False, False), (True, False), (True, True)],
    ids=["normal", "overlap", "overlap-device-flag"],
)
def test_nan_logits_abort_that_request_and_the_scheduler_keeps_serving(overlap, sync_free, monkeypatch):
    """`sync_free`: the finite check as a GPU runs it, its flag a device tensor read with the
    tokens when the result is processed."""
    poison, dec_prompt, clean = pick_poison_token()
    sched = make_scheduler(overlap=overlap)
    monkeypatch.setattr(sched.tp_worker.model_runner.sampler, "sync_free", sync_free)
    good = [gen_req(f"good{i}", p, 12) for i, p in enumerate(clean)]
    reqs = [
        gen_req("nan_prefill", clean[0][:4] + [poison] + clean[0][4:], 12),
        gen_req("nan_decode", dec_prompt, 12),
        *good,
    ]
    with nan_embedding(sched, poison):
        sched.io.put(*reqs)
        sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    for rid in ("nan_prefill", "nan_decode"):
        reason = results[rid].finished_reason
        assert reason["type"] == "abort" and reason["status_code"] == 500, (rid, reason)
        assert "NaN" in reason["message"]
    assert results["nan_decode"].output_ids == oracle_greedy(dec_prompt, 12)[:3]  # NaN once fed back
    assert_matches_oracle(good, results)
    # Nothing leaked, nothing poisoned: the same prompts again give the same tokens.
    again = [gen_req(f"again{i}", p, 12) for i, p in enumerate(clean)]
    sched.io.put(*again)
    sched.run_until_idle()
    assert_matches_oracle(again, collect(sched.io.take_outputs()))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_request_that_fails_to_initialise_fails_alone(overlap, tmp_path):
    """A stop string the tokenizer cannot encode (a lone surrogate, which the front end refuses
    first) makes the stop-string window raise: that request is finished with a 400, the others
    run, and the scheduler keeps serving."""
    from test_engine_utils import build_tokenizer

    # The model's EOS, as the oracle has it (not the tokenizer's).
    sched = make_scheduler(
        tokenizer=build_tokenizer(str(tmp_path)), overlap=overlap, eos_token_ids=frozenset({EOS})
    )
    _, _, clean = pick_poison_token()
    good = [gen_req(f"good{i}", p, 8) for i, p in enumerate(clean[:2])]
    sched.io.put(gen_req("bad", clean[0], 8, stop="\ud800"), *good)
    sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    reason = results["bad"].finished_reason
    assert (
        reason["type"] == "abort" and reason["status_code"] == 400 and "Invalid request" in reason["message"]
    )
    assert_matches_oracle(good, results)
    again = [gen_req("again", clean[1], 8)]
    sched.io.put(*again)
    sched.run_until_idle()
    assert_matches_oracle(again, collect(sched.io.take_outputs()))
