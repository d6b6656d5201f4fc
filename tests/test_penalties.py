"""frequency_penalty, presence_penalty, repetition_penalty and logit_bias (SGLang's semantics): the
sampler-level function on hand-made logits, the device-side output token counts through filter
and merge, and greedy decoding through the real scheduler against a step-by-step loop over the
same transformers model that applies the formulas by hand: both loops, page sizes 1 and 16,
retraction, mixed chunked prefill, and plain requests batched with penalised ones."""

from __future__ import annotations

import pytest
import torch
from sched_utils import (
    EOS,
    _hf_model,
    assert_no_leak,
    collect,
    gen_req,
    make_scheduler,
    oracle_greedy,
    random_prompts,
    run_to_completion,
)
from test_scheduler_equivalence import SYSTEM_A, count_mixed_batches, run_in_waves

from radixengine.layers.sampler import apply_penalties
from radixengine.sampling.output_token_counts import OutputTokenCounts, cumulate
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams

# Reference ---------------------------------------------------------------------------------------


def penalised_logits(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict | None = None,
) -> torch.Tensor:
    """The formulas, one row: subtract count * frequency_penalty and presence_penalty where the
    token occurred; then scale the logits of the tokens that occurred (a negative one times the
    repetition penalty, any other divided by it); then add logit_bias."""
    logits = logits.clone().float()
    for token in range(logits.shape[0]):
        n = float(counts[token])
        if n == 0:
            continue
        x = float(logits[token]) - frequency_penalty * n - presence_penalty
        logits[token] = x * repetition_penalty if x < 0 else x / repetition_penalty
    for token, bias in (logit_bias or {}).items():
        logits[int(token)] += bias
    return logits


@torch.no_grad()
def penalised_greedy(model, prompt: list[int], max_new_tokens: int, eos_id: int | None = None, **params):
    """Greedy decoding over a transformers model, the penalties applied by hand to each step's
    logits (only output tokens count); stops after `eos_id` when given."""
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab)
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    while True:
        token = int(penalised_logits(out.logits[0, -1], counts, **params).argmax())
        tokens.append(token)
        counts[token] += 1
        if len(tokens) >= max_new_tokens or token == eos_id:
            return tokens
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)


_REFERENCE: dict[tuple, list[int]] = {}


def reference(prompt: list[int], max_new_tokens: int, ignore_eos: bool, params: dict) -> list[int]:
    key = (tuple(prompt), max_new_tokens, ignore_eos, repr(sorted(params.items())))
    if key not in _REFERENCE:
        eos = None if ignore_eos else EOS
        _REFERENCE[key] = penalised_greedy(_hf_model(), prompt, max_new_tokens, eos, **params)
    return _REFERENCE[key]


def assert_matches_reference(reqs: list, results: dict, params: dict) -> None:
    for r in reqs:
        p = r.sampling_params
        expected = reference(r.input_ids, p.max_new_tokens, p.ignore_eos, params)
        assert results[r.rid].output_ids == expected, f"{r.rid}: tokens differ from the reference"


CASES = {
    "frequency": dict(frequency_penalty=1.0),
    "presence": dict(presence_penalty=1.5),
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_1": dict(repetition_penalty=0.5),
    "negative_frequency": dict(frequency_penalty=-0.7),
    "logit_bias": dict(logit_bias={"5": 3.0, "9": -100.0, "129": -2.5}),
    "all": dict(frequency_penalty=0.4, presence_penalty=0.6, repetition_penalty=1.3, logit_bias={"31": 1.5}),
}
PROMPTS = random_prompts(3, 4, 10, 30)


# Engine-level: greedy tokens against the reference ----------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_penalties_matches_reference(case, page_size, overlap):
    params = CASES[case]
    sched = make_scheduler(overlap=overlap, page_size=page_size)
    reqs = [
        gen_req(f"{case}{i}", p, max_new_tokens=24, ignore_eos=True, **params) for i, p in enumerate(PROMPTS)
    ]
    results = run_to_completion(sched, reqs)
    assert_matches_reference(reqs, results, params)
    # The parameters change something (else the test could not fail).
    assert any(results[r.rid].output_ids != oracle_greedy(r.input_ids, 24, True) for r in reqs)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_penalised_requests_stop_at_eos(overlap):
    """EOS stops a penalised request (its counts row leaves the batch with it)."""
    params = CASES["all"]
    prompts = random_prompts(21, 12, 4, 40)
    sched = make_scheduler(overlap=overlap)
    reqs = [gen_req(f"eos{i}", p, max_new_tokens=40, **params) for i, p in enumerate(prompts)]
    results = run_to_completion(sched, reqs)
    assert_matches_reference(reqs, results, params)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_retracted_requests_keep_their_counts(page_size, overlap):
    """A pool so small that decode retracts: a request that re-enters through a prefill gets its
    counts back from its own output ids."""
    params = CASES["all"]
    sched = make_scheduler(
        overlap=overlap,
        page_size=page_size,
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,  # an optimistic estimate: admits more than decode can hold
    )
    prompts = random_prompts(11, 8, 20, 50, shared=[SYSTEM_A[:24]])
    reqs = [gen_req(f"rt{i}", p, max_new_tokens=32, ignore_eos=True, **params) for i, p in enumerate(prompts)]
    results = run_in_waves(sched, reqs, first=8, steps_between=0)
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert_matches_reference(reqs, results, params)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_preempted_requests_keep_their_counts(overlap):
    """Priority preemption releases running penalised requests mid-decode; they come back with
    their counts rebuilt from their output ids."""
    params = CASES["all"]
    sched = make_scheduler(
        enable_priority_scheduling=True, max_total_tokens=160, init_new_token_ratio=1.0, overlap=overlap
    )
    prompts = random_prompts(704, 3, 20, 20)
    low = [
        gen_req(f"low{i}", p, 40, priority=0, ignore_eos=True, **params) for i, p in enumerate(prompts[:2])
    ]
    sched.io.put(*low)
    for _ in range(6):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    vip = gen_req("vip", prompts[2], 60, priority=100, ignore_eos=True, **params)
    sched.io.put(vip)
    sched.run_until_idle()
    assert sched.stats.num_preempted_reqs >= 1
    assert_no_leak(sched)
    assert_matches_reference([*low, vip], collect(sched.io.take_outputs()), params)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_chunk_with_penalties(page_size, overlap):
    """--enable-mixed-chunk: decode steps ride in prefill chunks (counts merged into the chunk's
    batch), with chunked prompts; plain and penalised requests together."""
    params = CASES["all"]
    sched = make_scheduler(
        overlap=overlap, page_size=page_size, chunked_prefill_size=32, enable_mixed_chunk=True
    )
    mixed_steps = count_mixed_batches(sched)
    prompts = random_prompts(31, 6, 5, 30) + random_prompts(32, 2, 70, 90)
    reqs = [
        gen_req(f"mx{i}", p, max_new_tokens=20, ignore_eos=True, **(params if i % 2 else {}))
        for i, p in enumerate(prompts)
    ]
    results = run_in_waves(sched, reqs, first=3, steps_between=4)
    assert mixed_steps() > 0
    assert_matches_reference([r for i, r in enumerate(reqs) if i % 2], results, params)
    for r in reqs[::2]:
        assert results[r.rid].output_ids == oracle_greedy(r.input_ids, 20, True)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_plain_requests_batched_with_penalised_ones_are_unchanged(overlap):
    """Plain requests get their tokens alone (transformers' greedy) whatever penalised requests
    share their batches, arriving before and after them."""
    sched = make_scheduler(overlap=overlap)
    prompts = random_prompts(41, 9, 5, 40)
    cases = [{}, CASES["all"], {}, CASES["repetition"], {}, CASES["logit_bias"], {}, CASES["frequency"], {}]
    reqs = [gen_req(f"mix{i}", p, max_new_tokens=16 + i, **c) for i, (p, c) in enumerate(zip(prompts, cases))]
    sched.io.put(*reqs[:4])
    for _ in range(3):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    sched.io.put(*reqs[4:])
    sched.run_until_idle()
    assert_no_leak(sched)
    results = collect(sched.io.take_outputs())
    for r, c in zip(reqs, cases):
        expected = reference(r.input_ids, r.sampling_params.max_new_tokens, False, c)
        assert results[r.rid].output_ids == expected, r.rid
        if not c:
            assert expected == oracle_greedy(r.input_ids, r.sampling_params.max_new_tokens)


def test_sampled_requests_with_penalties_finish():
    """Sampling (temperature, top-p, a seed) after the penalties: runs and finishes in both loops
    with the same tokens (seeded rows depend only on their own logits)."""
    params = dict(CASES["all"], temperature=0.8, top_p=0.9, sampling_seed=5, ignore_eos=True)
    outs = []
    for overlap in (False, True):
        sched = make_scheduler(overlap=overlap)
        reqs = [gen_req(f"s{i}", p, max_new_tokens=16, **params) for i, p in enumerate(PROMPTS)]
        results = run_to_completion(sched, reqs)
        outs.append([results[r.rid].output_ids for r in reqs])
    assert outs[0] == outs[1]


def test_logit_bias_beyond_the_vocabulary_is_refused_alone():
    sched = make_scheduler()
    good = gen_req("good", PROMPTS[0], max_new_tokens=8)
    bad = gen_req("bad", PROMPTS[1], max_new_tokens=8, logit_bias={"256": 1.0})
    results = run_to_completion(sched, [good, bad])
    reason = results["bad"].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "logit_bias" in reason["message"] and "[0, 255]" in reason["message"]
    assert results["good"].output_ids == oracle_greedy(PROMPTS[0], 8)


# SamplingParams ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", "1"),
        ("presence_penalty", 3),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("repetition_penalty", -1),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"-1": 1.0}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"5": float("inf")}),
        ("logit_bias", {"5": "x"}),
        ("logit_bias", [5, 1.0]),
    ],
)
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_values_and_vocab_check():
    p = SamplingParams(
        frequency_penalty=-2,
        presence_penalty=2.0,
        repetition_penalty=2,
        logit_bias={"0": -100, 7: 100, "07": 0.5},
    )
    assert p.has_penalties and p.logit_bias_by_id() == {0: -100.0, 7: 0.5}
    assert not SamplingParams(logit_bias={"3": 1.0}).has_penalties
    p.verify(vocab_size=8)
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids in \[0, 6\], got 7"):
        p.verify(vocab_size=7)


# The sampler-level function on hand-made logits -------------------------------------------------


def _info(params: list[SamplingParams], output_ids: list[list[int]], vocab: int) -> SamplingBatchInfo:
    info = SamplingBatchInfo.from_sampling_params(params, [len(o) for o in output_ids], "cpu", vocab)
    if info.need_penalties:
        info.output_token_counts = OutputTokenCounts.from_output_ids(output_ids, vocab, "cpu")
        info.output_token_counts_out = torch.empty((len(params), vocab))
    return info


def test_apply_penalties_on_hand_made_logits():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -4.0],
            [2.0, -1.0, 0.5, 3.0, -4.0],
            [2.0, -1.0, 0.5, 3.0, -4.0],
            [2.0, -1.0, 0.5, 3.0, -4.0],
        ]
    )
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(logit_bias={"1": 10.0, "4": -100}),
        SamplingParams(),
    ]
    outputs = [[0, 0, 1], [0, 1, 1, 2], [0, 0], [3, 3]]
    info = _info(params, outputs, 5)
    got = apply_penalties(logits, info)
    expected = torch.tensor(
        [
            [2.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 3.0, -4.0],
            [1.0, -2.0, 0.25, 3.0, -4.0],
            [2.0, 9.0, 0.5, 3.0, -104.0],
            [2.0, -1.0, 0.5, 3.0, -4.0],
        ]
    )
    assert torch.equal(got, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0]))  # out of place
    for row, (p, out) in enumerate(zip(params, outputs)):
        counts = torch.bincount(torch.tensor(out), minlength=5)
        ref = penalised_logits(
            logits[row],
            counts,
            p.frequency_penalty,
            p.presence_penalty,
            p.repetition_penalty,
            p.logit_bias,
        )
        assert torch.allclose(got[row], ref)
    # The counts this step used, then the sampled tokens added to them.
    cumulate_ids = torch.tensor([4, 1, 0, 3])
    info.cumulate_output_tokens(cumulate_ids)
    expected_counts = torch.stack(
        [
            torch.bincount(torch.tensor(o + [t]), minlength=5).float()
            for o, t in zip(outputs, cumulate_ids.tolist())
        ]
    )
    assert torch.equal(info.output_token_counts_out, expected_counts)


def test_repetition_and_subtraction_order():
    """Subtraction first, then the scaling sees the subtracted logit's sign."""
    logits = torch.tensor([[0.5, 1.0]])
    info = _info([SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)], [[0]], 2)
    assert torch.equal(apply_penalties(logits, info), torch.tensor([[-1.0, 1.0]]))


def test_no_penalties_is_a_no_op():
    logits = torch.randn(3, 11)
    info = _info(
        [SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(min_new_tokens=2)], [[]] * 3, 11
    )
    assert not info.need_penalties and info.logit_bias_rows is None
    assert apply_penalties(logits, info) is logits
    info.cumulate_output_tokens(torch.zeros(3, dtype=torch.int64))  # nothing to count


def test_unpenalised_rows_of_a_penalised_batch_are_bit_identical():
    logits = torch.randn(2, 50) * 5
    logits[1, 3] = float("-inf")
    info = _info(
        [SamplingParams(frequency_penalty=2.0, repetition_penalty=1.5), SamplingParams()],
        [[1, 2], [3, 3]],
        50,
    )
    got = apply_penalties(logits, info)
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


def test_output_token_counts_filter_merge_gather():
    vocab = 6
    a = OutputTokenCounts.from_output_ids([[1], [2, 2], [], [5]], vocab, "cpu")
    b = OutputTokenCounts.zeros(2, vocab)
    c = OutputTokenCounts.from_output_ids([[0, 0, 0]], vocab, "cpu")
    merged = a.filter([1, 3], "cpu").merge(b).merge(c).filter([0, 2, 3, 4], "cpu")
    merged = merged.filter([0, 1, 3], "cpu")
    got = merged.gather_into(torch.full((3, vocab), 7.0))
    expected = torch.tensor([[0, 0, 2, 0, 0, 0], [0, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0]], dtype=torch.float32)
    assert merged.size == 3 and torch.equal(got, expected)
    counts = expected.clone()
    cumulate(counts, torch.tensor([2, 4, 0]))
    assert counts[:, [2, 4, 0]].diagonal().tolist() == [3.0, 1.0, 4.0]


def test_penalties_without_counts_fail_clearly():
    info = SamplingBatchInfo.from_sampling_params([SamplingParams(presence_penalty=1.0)], [0], "cpu", 5)
    with pytest.raises(ValueError, match="output token counts"):
        apply_penalties(torch.zeros(1, 5), info)
