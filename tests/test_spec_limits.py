"""Speculative decoding at the edges of a request and of the models: drafts near the end of the
context (max_new_tokens, the req_to_token row) in both loops and both algorithms; a STANDALONE
draft model of another vocabulary or tokenizer refused at start (the tokenizer through the real
server); one whose context is shorter than the
target's drafts while it fits, then the request decodes plainly. Greedy output equals
transformers' and the token accounting holds after each (run_to_completion checks it)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import transformers
from sched_utils import (
    TINY_LLAMA,
    assert_matches_oracle,
    gen_req,
    random_prompts,
    run_to_completion,
    tiny_model_dir,
)
from test_speculative_scheduler import (
    LOOPS,
    SPEC,
    make_scheduler,
    oracle_continuations,
    script_drafts,
    standalone,
)

CONTEXT = TINY_LLAMA["max_position_embeddings"]  # the tiny target's context; its rows hold 4 more
MAX_REQ_LEN = CONTEXT - 1  # prompt + max_new_tokens, at most (the prompt: 6 fewer)


def _near_the_end(seed: int) -> list:
    """Requests whose prompt + max_new_tokens reach the end of the context: a full draft from
    their last steps would run past their req_to_token row."""
    long = random_prompts(seed, 3, MAX_REQ_LEN - 16, MAX_REQ_LEN - 6)
    reqs = [gen_req(f"end{i}", p, MAX_REQ_LEN - len(p), ignore_eos=True) for i, p in enumerate(long)]
    short = random_prompts(seed + 1, 1, 10, 20)[0]
    return [*reqs, gen_req("short", short, 20, ignore_eos=True)]


@pytest.mark.parametrize("page", [1, 16])
@LOOPS
def test_ngram_drafts_stop_at_the_end_of_the_context(monkeypatch, page, overlap):
    reqs = _near_the_end(700)
    script_drafts(monkeypatch, oracle_continuations([r.input_ids for r in reqs], 40))
    sched = make_scheduler(page_size=page, overlap=overlap, **SPEC)
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert all(results[r.rid].finished_reason["type"] == "length" for r in reqs)
    assert sched.stats.num_spec_verify_reqs > 0


@pytest.mark.parametrize("page", [1, 16])
@LOOPS
def test_draft_model_drafts_stop_at_the_end_of_the_context(page, overlap):
    reqs = _near_the_end(701)
    sched = standalone(tiny_model_dir(), steps=7, page_size=page, overlap=overlap)
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert sched.stats.avg_spec_accept_length > 3.0  # the draft is the target: runs accepted whole
    _assert_draft_pools_free(sched)


def _assert_draft_pools_free(sched) -> None:
    draft = sched.drafter.runner
    assert draft.token_to_kv_pool_allocator.available_size() == draft.token_to_kv_pool_allocator.size
    assert draft.req_to_token_pool.available_size() == draft.req_to_token_pool.size


def _copy_of_target(tmp_path, **config) -> str:
    """The tiny target's weights, with `config` changed."""
    folder = tmp_path / "draft"
    shutil.copytree(tiny_model_dir(), folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return str(folder)


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(tmp_path):
    import torch

    folder = tmp_path / "draft"
    config = transformers.LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1, "vocab_size": 300})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    with pytest.raises(ValueError, match="draft model's vocabulary has 300 tokens, the target's 256"):
        standalone(str(folder))


@LOOPS
def test_a_draft_model_of_a_shorter_context_drafts_while_it_fits(tmp_path, caplog, overlap):
    draft_context = 96
    draft = _copy_of_target(tmp_path, max_position_embeddings=draft_context)
    with caplog.at_level(logging.WARNING):
        sched = standalone(draft, steps=3, overlap=overlap)
    assert f"the draft model's context ({draft_context} tokens) is shorter than the target's ({CONTEXT})" in (
        caplog.text
    )
    long = random_prompts(702, 2, 150, 300)  # past the draft's context from the start
    crossing = random_prompts(703, 1, 70, 70)[0]  # drafts, then crosses the draft's context
    short = random_prompts(704, 1, 10, 20)[0]
    reqs = [gen_req(f"long{i}", p, 20, ignore_eos=True) for i, p in enumerate(long)]
    reqs += [gen_req("crossing", crossing, 50, ignore_eos=True), gen_req("short", short, 30, ignore_eos=True)]
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert sched.stats.avg_spec_accept_length > 3.0  # drafted (and accepted) where it fit
    _assert_draft_pools_free(sched)


def _refused_at_start(target: str, draft: str, log) -> str:
    """The server's log once it exited (it must refuse to start)."""
    from test_engine_utils import start_test_server

    args = ["--dtype", "float32", "--num-threads", "1", "--speculative-algorithm", "STANDALONE"]
    proc = start_test_server(target, log, [*args, "--speculative-draft-model-path", draft])
    try:
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.read_text()


def test_the_server_refuses_a_draft_of_another_tokenizer(tmp_path):
    """Through the real server: a draft model of the target's vocabulary size whose tokenizer
    gives two tokens each other's ids stops the start with the reason (another vocabulary size:
    test_a_draft_model_of_another_vocabulary_is_refused_at_start)."""
    from test_engine_utils import build_tiny_model

    target = build_tiny_model(str(tmp_path / "target"))
    swapped = tmp_path / "swapped"
    shutil.copytree(target, swapped)
    path = swapped / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    path.write_text(json.dumps(tokenizer))
    log = _refused_at_start(target, str(swapped), tmp_path / "swapped.log")
    assert "the draft model's tokenizer differs from the target's (token 'a'" in log
