"""Speculative decoding (NGRAM) in the scheduler: greedy output equals transformers' whatever the
drafts (the n-gram drafter's own, perfect ones, corrupted ones), across policies, radix on/off,
page sizes, chunked prefill and forced retraction; stops and max_new_tokens inside an accepted run
cut the output exactly; seeded sampling emits the very tokens it does without speculation;
logprobs of every accepted token; the rejected drafts' KV freed (the token accounting after every
test); the budget rule that turns speculation off for large batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sched_utils
from sched_utils import (
    assert_matches_oracle,
    assert_no_leak,
    collect,
    gen_req,
    oracle_greedy,
    random_prompts,
    run_to_completion,
)
from test_scheduler_equivalence import SYSTEM_A, run_in_waves, workload

from radixengine.managers.io_struct import AbortReq
from radixengine.managers.scheduler_components.speculative_drafter import SpeculativeDrafter
from radixengine.server_args import ServerArgs
from radixengine.speculative.ngram_index import NgramDraft, NgramIndex

# A budget that lets the tests' batches (up to ~20 requests) verify; the default's rule has its own test.
SPEC = dict(speculative_algorithm="NGRAM", speculative_max_verify_tokens=128)
# Both step orders: the normal one, and the overlap loop (verify steps launched before the result
# of the step before them is processed, speculative/spec_overlap.py).
LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])


def make_scheduler(overlap: bool = False, **kw):
    """sched_utils' scheduler, checked to run the loop asked for."""
    sched = sched_utils.make_scheduler(overlap=overlap, **kw)
    assert sched.enable_overlap == overlap
    return sched


class ScriptedIndex:
    """Drafts the next tokens of a known continuation, optionally with one token corrupted."""

    def __init__(self, req, continuation: list[int], corrupt: bool, width: int = 8, ahead: int = 0) -> None:
        self.req, self.continuation, self.corrupt, self.width = req, continuation, corrupt, width
        self.ahead = ahead  # tokens of a step in flight the draft follows (overlap)

    def draft(self, shared=None) -> NgramDraft:
        req = self.req
        done = len(req.output_ids) + self.ahead
        full = self.continuation
        tokens = [(req.output_ids or [0])[-1], *full[done : done + self.width - 1]]
        if self.corrupt and len(tokens) > 2:
            j = int(np.random.default_rng(done).integers(1, len(tokens)))
            tokens[j] = (tokens[j] + 1) % 200 + 2
        return NgramDraft(np.array(tokens, dtype=np.int64), np.arange(-1, len(tokens) - 1))


def script_drafts(
    monkeypatch, continuations: dict[tuple, list[int]], corrupt: bool = False, key=None
) -> None:
    """Every request drafts from its known continuation (the budget still trims the drafts),
    found by `key(req)` (default: its prompt)."""
    key = key or (lambda req: tuple(req.origin_input_ids))

    def draft_one(self, req, paced, sources=()):
        width = self.config.params.num_draft_tokens
        return ScriptedIndex(req, continuations[key(req)], corrupt, width).draft()

    def propose_one(self, req, extra, paced, sources=()):  # the overlap loop's: after the step in flight
        width = self.config.params.num_draft_tokens + (extra is not None)  # as NgramIndex.draft_after
        scripted = ScriptedIndex(req, continuations[key(req)], corrupt, width, len(extra or ()))
        return scripted.draft().tokens[1:].tolist()

    monkeypatch.setattr(SpeculativeDrafter, "_draft_one", draft_one)
    monkeypatch.setattr(SpeculativeDrafter, "_propose_one", propose_one)


def oracle_continuations(prompts: list[list[int]], n: int) -> dict[tuple, list[int]]:
    return {tuple(p): oracle_greedy(p, n, ignore_eos=True) for p in prompts}


@pytest.mark.parametrize(
    "policy,page,chunk,radix",
    [("fcfs", 1, -1, True), ("lpm", 16, 32, True), ("dfs-weight", 1, 16, False), ("lpm", 16, -1, False)],
)
@LOOPS
def test_ngram_greedy_equals_transformers_across_the_matrix(policy, page, chunk, radix, overlap):
    sched = make_scheduler(
        overlap=overlap,
        schedule_policy=policy,
        page_size=page,
        chunked_prefill_size=chunk,
        disable_radix_cache=not radix,
        **SPEC,
    )
    reqs = workload("s")
    results = run_in_waves(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert sched.stats.num_spec_verify_reqs > 0


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("corrupt", [False, True], ids=["perfect", "corrupted"])
@LOOPS
def test_scripted_drafts_stay_exact(monkeypatch, page, corrupt, overlap):
    prompts = random_prompts(600, 4, 10, 30)
    script_drafts(monkeypatch, oracle_continuations(prompts, 90), corrupt)
    sched = make_scheduler(page_size=page, overlap=overlap, **SPEC)
    assert sched.enable_overlap == overlap
    reqs = [gen_req(f"r{i}", p, 50 + 7 * i, ignore_eos=True) for i, p in enumerate(prompts)]
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    accept = sched.stats.avg_spec_accept_length
    assert (2.0 < accept < 6.0) if corrupt else accept > 7.0
    assert sched.stats.num_forward_steps < (40 if corrupt else 20)  # 50..71 tokens each


@pytest.mark.parametrize("page", [1, 16])
@LOOPS
def test_retraction_under_speculation_stays_exact(page, overlap):
    sched = make_scheduler(
        overlap=overlap,
        page_size=page,
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,  # an optimistic estimate: admits more than decode can hold
        **SPEC,
    )
    prompts = random_prompts(11, 8, 20, 50, shared=[SYSTEM_A[:24]])
    reqs = [gen_req(f"rt{i}", p, max_new_tokens=32) for i, p in enumerate(prompts)]
    results = run_in_waves(sched, reqs, first=8, steps_between=0)
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert sched.stats.num_spec_verify_reqs > 0
    assert_matches_oracle(reqs, results)


@pytest.mark.parametrize("page", [1, 16])
@LOOPS
def test_stops_and_max_new_tokens_inside_an_accepted_run(monkeypatch, page, overlap):
    """Drafts that run past a stop token, past max_new_tokens, and over a stop token that
    min_new_tokens masks: the output is cut exactly where plain decoding stops."""
    prompts = random_prompts(602, 3, 12, 12)
    conts = oracle_continuations(prompts, 40)
    script_drafts(monkeypatch, conts)
    no_eos = frozenset()  # only the stop token ids stop these
    stop_tok = conts[tuple(prompts[0])][9]
    min_stop = conts[tuple(prompts[2])][1]
    reqs = [
        gen_req("stop", prompts[0], 30, stop_token_ids=[stop_tok]),
        gen_req("len", prompts[1], 11),  # ends in the middle of a run of 8
        gen_req("min", prompts[2], 30, stop_token_ids=[min_stop], min_new_tokens=5),
    ]
    spec = run_to_completion(
        make_scheduler(page_size=page, eos_token_ids=no_eos, overlap=overlap, **SPEC), reqs
    )
    plain = run_to_completion(make_scheduler(page_size=page, eos_token_ids=no_eos), reqs)
    cont = conts[tuple(prompts[0])]
    assert spec["stop"].output_ids == cont[: cont.index(stop_tok) + 1]
    assert spec["stop"].finished_reason == {"type": "stop", "matched": stop_tok}
    assert spec["len"].output_ids == conts[tuple(prompts[1])][:11]
    assert spec["len"].finished_reason["type"] == "length"
    assert len(spec["min"].output_ids) >= 5
    for rid in plain:
        assert (spec[rid].output_ids, spec[rid].finished_reason) == (
            plain[rid].output_ids,
            plain[rid].finished_reason,
        )


def _sampled(sched, reqs):
    return {rid: r.output_ids for rid, r in run_to_completion(sched, reqs).items()}


@LOOPS
def test_seeded_sampling_emits_the_same_tokens_with_speculation(monkeypatch, overlap):
    """A seeded request draws node j's uniform from (seed, step + depth), the one plain decoding
    draws at that step: its tokens do not change, whatever the drafts."""
    prompts = random_prompts(603, 3, 8, 16)
    params = dict(temperature=0.9, top_p=0.95, top_k=50, sampling_seed=7, ignore_eos=True)
    reqs = [gen_req(f"s{i}", p, 40, **params) for i, p in enumerate(prompts)]
    plain = _sampled(make_scheduler(), reqs)
    script_drafts(monkeypatch, {tuple(p): plain[f"s{i}"] for i, p in enumerate(prompts)}, corrupt=True)
    sched = make_scheduler(overlap=overlap, **SPEC)
    assert _sampled(sched, reqs) == plain
    assert sched.stats.avg_spec_accept_length > 2.0


@LOOPS
def test_logprobs_of_every_accepted_token(monkeypatch, overlap):
    prompts = random_prompts(604, 2, 8, 16)
    script_drafts(monkeypatch, oracle_continuations(prompts, 30))
    reqs = [gen_req(f"l{i}", p, 20, ignore_eos=True) for i, p in enumerate(prompts)]
    for r in reqs:
        r.return_logprob, r.top_logprobs_num, r.logprob_start_len = True, 3, 0

    def logprobs(sched):
        sched.io.put(*reqs)
        sched.run_until_idle()
        out = {}
        for msg in sched.io.take_outputs():
            for i, rid in enumerate(msg.rids):
                lp, top = msg.output_token_logprobs[i], msg.output_top_logprobs_val[i]
                out.setdefault(rid, ([], []))
                out[rid][0].extend(lp)
                out[rid][1].extend(top)
        assert_no_leak(sched)
        return out

    plain, spec = logprobs(make_scheduler()), logprobs(make_scheduler(overlap=overlap, **SPEC))
    for rid in plain:
        assert len(spec[rid][0]) == len(plain[rid][0]) == 20
        np.testing.assert_allclose(spec[rid][0], plain[rid][0], atol=2e-4)
        np.testing.assert_allclose(np.array(spec[rid][1]), np.array(plain[rid][1]), atol=2e-4)


@LOOPS
def test_large_batches_decode_plainly(overlap):
    """The verify budget (32 tokens a step by default) leaves a batch of 40 no draft a request: it
    decodes plainly, and its outputs are the plain ones."""
    prompts = random_prompts(605, 40, 4, 12)
    reqs = [gen_req(f"b{i}", p, 6) for i, p in enumerate(prompts)]
    sched = make_scheduler(overlap=overlap, speculative_algorithm="NGRAM")  # the default budget
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert sched.stats.num_spec_verify_reqs < 40 * 5  # only once requests have left the batch


@LOOPS
def test_one_draft_a_request_is_not_worth_a_verify_step(monkeypatch, overlap):
    """At the default budget (32 tokens a step) a batch of 16 leaves each request 2 nodes, one
    draft: it decodes plainly though perfect drafts are at hand; a batch of 10 (3 nodes) verifies."""
    for batch, verifies in ((16, False), (10, True)):
        prompts = random_prompts(607 + batch, batch, 4, 12)
        script_drafts(monkeypatch, oracle_continuations(prompts, 16))
        reqs = [gen_req(f"o{i}", p, 6, ignore_eos=True) for i, p in enumerate(prompts)]
        sched = make_scheduler(overlap=overlap, speculative_algorithm="NGRAM")
        assert_matches_oracle(reqs, run_to_completion(sched, reqs))
        assert (sched.stats.num_spec_verify_reqs > 0) == verifies


def test_verify_nodes_per_request_follow_the_budget():
    from radixengine.speculative.spec_pacing import verify_nodes_per_request

    assert verify_nodes_per_request(32, 1, 8) == 8
    assert verify_nodes_per_request(32, 8, 8) == 4
    assert verify_nodes_per_request(32, 10, 8) == 3
    assert verify_nodes_per_request(32, 11, 8) == 0  # two nodes: one draft a request does not pay
    assert verify_nodes_per_request(32, 16, 2) == 2  # the drafter's own limit of one draft stands
    assert verify_nodes_per_request(32, 17, 2) == 0


@LOOPS
def test_requests_whose_drafts_fail_stop_drafting_for_a_while(overlap, monkeypatch):
    """Random text (the tiny model's outputs never repeat its prompt): after a verify step gives
    too few tokens (or, under overlap, a draft is dropped) a request pauses, longer after each
    miss, so it drafts in few of its steps. Three requests: their drafts would take more than
    FREE_VERIFY_TOKENS a step."""
    drafted = count_drafts(monkeypatch)
    prompts = random_prompts(606, 3, 30, 30)
    reqs = [gen_req(f"a{i}", p, 120, ignore_eos=True) for i, p in enumerate(prompts)]
    sched = make_scheduler(overlap=overlap, **SPEC)
    assert_matches_oracle(reqs, run_to_completion(sched, reqs))
    assert 0 < sum(drafted) < 3 * 120 // 8 and len(drafted) < 3 * 120 // 4


@LOOPS
def test_a_small_batch_drafts_every_step(overlap, monkeypatch):
    """Two requests: the step's drafts fit in FREE_VERIFY_TOKENS, where a verify costs a decode
    step, so no request pauses however its drafts fare."""
    drafted = count_drafts(monkeypatch)
    prompts = random_prompts(606, 2, 30, 30)
    reqs = [gen_req(f"a{i}", p, 120, ignore_eos=True) for i, p in enumerate(prompts)]
    sched = make_scheduler(overlap=overlap, **SPEC)
    assert_matches_oracle(reqs, run_to_completion(sched, reqs))
    assert len(drafted) >= 2 * 120 // 2 and sum(drafted) > 2 * 120 // 8


def count_drafts(monkeypatch) -> list[bool]:
    """Whether each draft the requests' n-gram indexes make holds a drafted token."""
    drafted: list[bool] = []
    draft = NgramIndex._draft

    def counted(self, *args):
        out = draft(self, *args)
        drafted.append(out.num_nodes > 1)
        return out

    monkeypatch.setattr(NgramIndex, "_draft", counted)
    return drafted


def test_the_budget_left_by_short_drafts_goes_to_the_best_drafters():
    from radixengine.speculative.spec_pacing import share_verify_nodes

    # an even share of 4 each; request 1 drafts nothing, request 3 little: their 5 nodes go to the
    # requests that want more, the one with the best record first
    assert share_verify_nodes([8, 1, 8, 2, 8], [1.5, 3.0, 4.0, 1.0, 2.0], 20, 4) == [4, 1, 8, 2, 5]
    assert share_verify_nodes([8, 8], [1.0, 1.0], 16, 8) == [8, 8]  # nothing left over
    assert share_verify_nodes([3, 3, 3], [1.0, 2.0, 3.0], 32, 8) == [3, 3, 3]  # never more than wanted


def test_speculation_runs_the_overlap_loop_unless_it_is_disabled():
    assert make_scheduler(overlap=True, **SPEC).enable_overlap
    assert not make_scheduler(overlap=False, **SPEC).enable_overlap  # --disable-overlap-schedule


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(speculative_algorithm="EAGLE"), "must be one of NGRAM, STANDALONE"),
        (dict(speculative_algorithm="STANDALONE"), "needs --speculative-draft-model-path"),
        (
            dict(
                speculative_algorithm="STANDALONE", speculative_draft_model_path="d", speculative_num_steps=0
            ),
            "num-steps must be >= 1",
        ),
        (
            dict(
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path="d",
                speculative_num_steps=3,
                speculative_num_draft_tokens=6,
            ),
            "must be --speculative-num-steps \\+ 1",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="x"), "NGRAM takes no draft model"),
        (dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=3), "tree drafts"),
        (
            dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1),
            "num_draft_tokens must be >= 2",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_max_verify_tokens=1), "max-verify-tokens"),
        (dict(speculative_algorithm="NGRAM", speculative_ngram_capacity=1), "capacity must be 0 .* or >= 4"),
        (dict(speculative_algorithm="NGRAM", speculative_ngram_capacity=3), "capacity must be 0 .* or >= 4"),
        (dict(speculative_algorithm="NGRAM", speculative_ngram_capacity=-1), "capacity"),
    ],
)
def test_unusable_speculative_configurations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_speculation_takes_tensor_parallelism():
    """--tp-size > 1 runs both algorithms (tests/test_speculative_tp.py)."""
    ServerArgs(speculative_algorithm="NGRAM", tp_size=2)
    ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d", tp_size=2)


@pytest.mark.parametrize("interval", [1, 3])
@LOOPS
def test_streaming_sends_each_token_once(monkeypatch, interval, overlap):
    """A verify step adds several tokens at once: every message carries what is new, each token
    exactly once, the first at once and then at least every `interval` tokens."""
    prompts = random_prompts(607, 2, 10, 20)
    script_drafts(monkeypatch, oracle_continuations(prompts, 40))
    reqs = [gen_req(f"st{i}", p, 33, ignore_eos=True) for i, p in enumerate(prompts)]
    for r in reqs:
        r.stream = True
    sched = make_scheduler(stream_interval=interval, overlap=overlap, **SPEC)
    sched.io.put(*reqs)
    sched.run_until_idle()
    msgs = sched.io.take_outputs()
    results = collect(msgs)
    assert_matches_oracle(reqs, results)
    assert_no_leak(sched)
    sizes = [len(m.output_ids[i]) for m in msgs for i, rid in enumerate(m.rids) if rid == "st0"]
    assert sizes[0] == 1 and sum(sizes) == 33 and len(sizes) < 33
    assert all(n >= min(interval, 2) for n in sizes[1:-1])
    assert max(sizes[1:]) <= 8  # sent the step they were taken (a verify gives at most 8)


@LOOPS
def test_the_trace_shows_draft_verify_and_accept(monkeypatch, tmp_path, overlap):
    prompts = random_prompts(608, 2, 10, 20)
    script_drafts(monkeypatch, oracle_continuations(prompts, 30))
    trace = tmp_path / "trace.json"
    sched = make_scheduler(trace_file=str(trace), overlap=overlap, **SPEC)
    run_to_completion(sched, [gen_req(f"t{i}", p, 24, ignore_eos=True) for i, p in enumerate(prompts)])
    sched.write_trace()
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"draft", "verify", "accept"} <= names


# STANDALONE: a draft model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory) -> str:
    """A smaller random model of the same vocabulary (one layer, other weights)."""
    import torch
    import transformers
    from sched_utils import TINY_LLAMA

    folder = tmp_path_factory.mktemp("draft")
    torch.manual_seed(99)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1})
    config.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return str(folder)


def standalone(draft: str, steps: int = 3, **kw):
    return make_scheduler(
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        **{"speculative_max_verify_tokens": 128, **kw},
    )


@pytest.mark.parametrize("page", [1, 16])
@LOOPS
def test_a_draft_equal_to_the_target_accepts_everything(page, overlap):
    from sched_utils import tiny_model_dir

    prompts = random_prompts(610, 4, 10, 30)
    reqs = [gen_req(f"d{i}", p, 30 + 5 * i, ignore_eos=True) for i, p in enumerate(prompts)]
    sched = standalone(tiny_model_dir(), page_size=page, overlap=overlap)
    assert_matches_oracle(reqs, run_to_completion(sched, reqs))
    assert sched.stats.avg_spec_accept_length > 3.8  # 3 drafts + the bonus a step
    draft = sched.drafter.runner  # every draft slot and row back once the requests finished
    assert draft.token_to_kv_pool_allocator.available_size() == draft.token_to_kv_pool_allocator.size
    assert draft.req_to_token_pool.available_size() == draft.req_to_token_pool.size


@LOOPS
def test_an_unrelated_draft_still_gives_exact_output(unrelated_draft, overlap):
    sched = standalone(unrelated_draft, steps=4, chunked_prefill_size=32, overlap=overlap)
    reqs = workload("u")
    results = run_in_waves(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert sched.stats.num_spec_verify_reqs > 0


@LOOPS
def test_draft_model_retraction_and_seeded_sampling(unrelated_draft, overlap):
    from sched_utils import tiny_model_dir

    sched = standalone(
        tiny_model_dir(),
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,
        overlap=overlap,
    )
    prompts = random_prompts(11, 8, 20, 50, shared=[SYSTEM_A[:24]])
    reqs = [gen_req(f"rt{i}", p, max_new_tokens=32) for i, p in enumerate(prompts)]
    results = run_in_waves(sched, reqs, first=8, steps_between=0)
    assert sched.stats.num_retracted_reqs > 0
    assert_matches_oracle(reqs, results)
    params = dict(temperature=0.9, top_p=0.95, sampling_seed=5, ignore_eos=True)
    sampled = [gen_req(f"x{i}", p, 30, **params) for i, p in enumerate(random_prompts(611, 3, 8, 16))]
    spec = standalone(tiny_model_dir(), overlap=overlap)
    assert _sampled(spec, sampled) == _sampled(make_scheduler(), sampled)


@pytest.mark.parametrize("page", [1, 16])
@LOOPS
def test_nan_logits_inside_a_verify_abort_that_request_alone(monkeypatch, page, overlap):
    """A draft run that reaches a token whose embedding is NaN: the request's bonus token comes
    from a node with nothing to sample, so it is aborted with a 500 (its verify KV freed, not
    cached) after the drafts accepted from fine nodes; the other requests and the token
    accounting (checked by run_to_completion) are intact."""
    from test_scheduler_faults import nan_embedding, pick_poison_token

    poison, dec_prompt, clean = pick_poison_token()
    script_drafts(monkeypatch, oracle_continuations([dec_prompt, *clean], 16))
    sched = make_scheduler(page_size=page, overlap=overlap, **SPEC)
    good = [gen_req(f"good{i}", p, 12) for i, p in enumerate(clean)]
    reqs = [gen_req("nan", dec_prompt, 12), *good]
    with nan_embedding(sched, poison):
        results = run_to_completion(sched, reqs)
    reason = results["nan"].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "NaN" in reason["message"]
    # A prefix of plain decoding's tokens: the extend attention multiplies the NaN value of a
    # masked-out draft by 0, so the nodes before it may fail too (plain decoding emits 3 tokens).
    out = results["nan"].output_ids
    assert 1 <= len(out) <= 3 and out == oracle_greedy(dec_prompt, 12)[: len(out)]
    assert_matches_oracle(good, results)


# Under the overlap loop too ----------------------------------------------------------------------


@LOOPS
def test_abort_in_the_middle_of_accepted_runs(monkeypatch, overlap):
    """An abort while verify steps run (under overlap, one launched after the other): the request
    ends with what it had, the others are exact, nothing leaks."""
    prompts = random_prompts(612, 3, 10, 20)
    script_drafts(monkeypatch, oracle_continuations(prompts, 60))
    sched = make_scheduler(overlap=overlap, **SPEC)
    reqs = [gen_req(f"ab{i}", p, 60, ignore_eos=True) for i, p in enumerate(prompts)]
    sched.io.put(*reqs)
    for _ in range(4):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    sched.io.put(AbortReq(rid="ab1"))
    sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    assert_no_leak(sched)
    assert results["ab1"].finished_reason["type"] == "abort"
    out = results["ab1"].output_ids
    assert 0 < len(out) < 60 and out == oracle_greedy(prompts[1], 60, ignore_eos=True)[: len(out)]
    assert_matches_oracle([reqs[0], reqs[2]], results)


@LOOPS
def test_a_stop_string_inside_an_accepted_run(monkeypatch, overlap):
    from test_scheduler_features import CharTokenizer

    prompt = random_prompts(613, 1, 12, 12)[0]
    full = oracle_greedy(prompt, 30, ignore_eos=True)
    script_drafts(monkeypatch, {tuple(prompt): full})
    text = CharTokenizer.decode(full)
    stop = text[9:12]  # inside the second verify step's run
    end = text.index(stop) + len(stop)
    sched = make_scheduler(tokenizer=CharTokenizer(), overlap=overlap, **SPEC)
    results = run_to_completion(sched, [gen_req("s", prompt, 30, ignore_eos=True, stop=[stop])])
    assert results["s"].output_ids == full[:end]
    assert results["s"].finished_reason == {"type": "stop", "matched": stop}


@LOOPS
def test_mixed_chunk_penalties_and_seeds_with_speculation(monkeypatch, overlap):
    """Chunked prefill with --enable-mixed-chunk (under overlap with speculation a prefill takes no
    decode step), frequency penalties and seeded sampling: the tokens without speculation."""
    prompts = random_prompts(614, 4, 20, 40)
    params = dict(temperature=0.8, sampling_seed=11, frequency_penalty=0.5, ignore_eos=True)
    reqs = [gen_req(f"m{i}", p, 30, **params) for i, p in enumerate(prompts)]
    kw = dict(enable_mixed_chunk=True, chunked_prefill_size=16)
    plain = _sampled(make_scheduler(**kw), reqs)
    script_drafts(monkeypatch, {tuple(p): plain[f"m{i}"] for i, p in enumerate(prompts)}, corrupt=True)
    sched = make_scheduler(overlap=overlap, **kw, **SPEC)
    assert _sampled(sched, reqs) == plain
    assert sched.stats.avg_spec_accept_length > 2.0


@LOOPS
@pytest.mark.parametrize("page", [1, 16])
def test_requests_that_finish_before_their_verify_step_runs(monkeypatch, page, overlap):
    """max_new_tokens of 1 to 3: under overlap a verify step (its slots allocated ahead) is
    launched before the prefill or decode step that finishes the request is processed; those
    slots go with the request (the accounting checked by run_to_completion)."""
    prompts = random_prompts(615, 6, 10, 20)
    script_drafts(monkeypatch, oracle_continuations(prompts, 20))
    reqs = [gen_req(f"f{i}", p, 1 + i % 3, ignore_eos=True) for i, p in enumerate(prompts)]
    sched = make_scheduler(page_size=page, overlap=overlap, **SPEC)
    assert_matches_oracle(reqs, run_to_completion(sched, reqs))


@LOOPS
def test_a_draft_model_whose_drafts_fail_stops_running_for_a_while(unrelated_draft, overlap):
    """The unrelated draft's tokens are rejected: each request pauses drafting (longer after each
    miss) and a batch where no request drafts runs no draft forward and decodes plainly."""
    prompts = random_prompts(612, 2, 30, 30)
    reqs = [gen_req(f"p{i}", p, 120, ignore_eos=True) for i, p in enumerate(prompts)]
    sched = standalone(unrelated_draft, steps=3, overlap=overlap)
    assert sched.drafter.min_tokens_per_verify > 1.3
    calls = []
    real_forward = sched.drafter._forward
    sched.drafter._forward = lambda *a: calls.append(a[0]) or real_forward(*a)
    assert_matches_oracle(reqs, run_to_completion(sched, reqs))
    # Under overlap a miss shows earlier: the draft's first token predicts the bonus of the step
    # in flight, so its drafts are dropped before they verify.
    assert sched.stats.num_spec_verify_reqs < 2 * 120 // 8
    assert 0 < len(calls) < 120 // 2  # 3 forwards a drafting step; 120 steps if it never paused
    assert not sched.drafter.pacing and not sched.drafter.states  # forgotten once finished


def test_the_draft_models_threshold_follows_the_weights_it_reads(tmp_path):
    """A draft step costs its weights over the target's: a draft as large as the target can never
    pay (the threshold is above the most a step can give: the drafts + the bonus)."""
    import torch
    import transformers
    from sched_utils import TINY_LLAMA

    from radixengine.model_loader import ModelConfig
    from radixengine.speculative.spec_pacing import draft_model_min_tokens

    config = transformers.LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": True})
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(tmp_path)
    read = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    assert ModelConfig(str(tmp_path)).decode_weight_elements() == read  # the tied table is the LM head
    assert draft_model_min_tokens(read, read, 3) > 3 + 1
    assert draft_model_min_tokens(read // 10, read, 3) < 2
