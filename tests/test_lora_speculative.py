"""Speculative decoding with LoRA adapters: a verify step applies each request's adapter to its
whole draft tree, so every request of a batch mixing adapters and the base model still gets
transformers + peft's greedy tokens and logprobs with its adapter, whatever the drafts (perfect,
corrupted, the n-gram drafter's own, a draft model's), overlap on and off, page 1 and 16, under
forced retraction; the draft model runs without adapters."""

from __future__ import annotations

import pytest
from sched_utils import random_prompts, tiny_model_dir
from test_lora_scheduler import SHARED, assert_matches_peft, lora_req, make_lora_scheduler, reference, run
from test_speculative_scheduler import script_drafts

from radixengine.model_executor.forward_batch_info import ForwardMode

LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
NGRAM = dict(speculative_algorithm="NGRAM", speculative_max_verify_tokens=128)
NAMES = [None, "a", "b", "c"]


def workload(tag: str, max_new_tokens: int = 24):
    """Short prompts round-robin over the base model and three adapters, and one prompt under
    each of them (same tokens, four continuations)."""
    prompts = random_prompts(71, 8, 5, 25) + [SHARED] * len(NAMES)
    names = NAMES * 2 + NAMES
    which = {f"{tag}{i}": n for i, n in enumerate(names)}
    reqs = [lora_req(rid, p, which[rid], max_new_tokens) for rid, p in zip(which, prompts)]
    return reqs, which


def spy_verify_adapters(sched) -> list[int]:
    """The distinct adapters of every verify step the worker runs."""
    seen: list[int] = []
    forward = sched.tp_worker.forward_batch_generation

    def spy(mwb, *args, **kwargs):
        if mwb.forward_mode == ForwardMode.TARGET_VERIFY:
            seen.append(len({i for i in mwb.lora_ids or [] if i}))
        return forward(mwb, *args, **kwargs)

    sched.tp_worker.forward_batch_generation = spy
    return seen


def run_spied(sched, reqs) -> tuple[dict, list[int]]:
    seen = spy_verify_adapters(sched)
    try:
        return run(sched, reqs), seen
    finally:
        del sched.tp_worker.forward_batch_generation


@pytest.mark.parametrize("corrupt", [False, True], ids=["perfect", "corrupted"])
@pytest.mark.parametrize("page_size", [1, 16])
@LOOPS
def test_scripted_drafts_under_mixed_adapters_match_peft(monkeypatch, page_size, corrupt, overlap):
    """Each request drafts its own adapter's continuation: the verify accepts it only if it
    applies that adapter to the drafts (perfect drafts: nearly all accepted)."""
    reqs, which = workload("sd")
    continuations = {r.rid: reference(which[r.rid], r.input_ids, 24)[0] for r in reqs}
    script_drafts(monkeypatch, continuations, corrupt, key=lambda req: req.rid)
    sched = make_lora_scheduler(page_size, overlap=overlap, **NGRAM)
    out, adapters_per_verify = run_spied(sched, reqs)
    assert_matches_peft(reqs, which, out)
    assert max(adapters_per_verify) == 3, "a verify step must mix the three adapters"
    accept = sched.stats.avg_spec_accept_length
    assert (1.5 < accept < 6.0) if corrupt else accept > 5.0


@LOOPS
def test_ngram_drafts_with_adapters_under_retraction_match_peft(overlap):
    """The n-gram drafter's own drafts (repetitive prompts, so they draft) and a pool small
    enough to retract requests mid-run."""
    motifs = random_prompts(72, 8, 4, 6)
    prompts = [(m * 8)[:30] for m in motifs]
    which = {f"ng{i}": NAMES[i % 4] for i in range(len(prompts))}
    reqs = [lora_req(rid, p, which[rid], max_new_tokens=24) for rid, p in zip(which, prompts)]
    sched = make_lora_scheduler(
        16, max_total_tokens=320, overlap=overlap, init_new_token_ratio=0.05, chunked_prefill_size=64, **NGRAM
    )
    out, adapters_per_verify = run_spied(sched, reqs)
    assert_matches_peft(reqs, which, out)
    assert adapters_per_verify and max(adapters_per_verify) >= 2
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"


@LOOPS
def test_a_draft_model_drafts_as_the_base_model_and_the_verify_applies_adapters(overlap):
    """STANDALONE with the base model itself as the draft: it drafts without adapters (the base
    model's requests accept every draft, the adapters' requests only what agrees), and every
    request's output is its adapter's."""
    reqs, which = workload("dm")
    sched = make_lora_scheduler(
        overlap=overlap,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=tiny_model_dir(),
        speculative_num_steps=3,
        speculative_max_verify_tokens=128,
    )
    assert sched.drafter.runner.lora_manager is None
    out, adapters_per_verify = run_spied(sched, reqs)
    assert_matches_peft(reqs, which, out)
    assert max(adapters_per_verify) == 3
    assert sched.stats.avg_spec_accept_length > 1.0
