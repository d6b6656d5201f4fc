"""Our forward over the paged KV pool vs transformers on the same tiny random models (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

ARCHS = ["llama", "qwen2", "qwen3"]
LENGTHS = [37, 5, 18, 1]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    overrides = {"tie_word_embeddings": True} if request.param == "qwen2" else {}
    hf = save_tiny_model(request.param, folder, seed=ARCHS.index(request.param), **overrides)
    return folder, hf


def _prompts(seed: int, lengths=LENGTHS) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate(lengths)}


@pytest.mark.parametrize("page_size", [1, 16])
def test_full_prefill_ragged_batch(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    prompts = _prompts(1)
    logits = driver.extend(prompts)
    for i, tokens in enumerate(prompts.values()):
        assert_close_rel(logits[i], hf_last_logits(hf, tokens))


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_split_into_cached_prefix_and_extend(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    prompts = _prompts(2, [40, 23, 9, 17])
    rng = random.Random(3)
    cuts = {rid: rng.randrange(1, len(t)) for rid, t in prompts.items()}
    driver.extend({rid: t[: cuts[rid]] for rid, t in prompts.items()})
    # Second chunk in two batches of different composition, a third chunk for one request.
    rids = list(prompts)
    mids = {rid: (cuts[rid] + len(prompts[rid])) // 2 for rid in rids}
    driver.extend({rid: prompts[rid][cuts[rid] : mids[rid]] for rid in rids if mids[rid] > cuts[rid]})
    logits = driver.extend({rid: prompts[rid][mids[rid] :] for rid in rids})
    for i, tokens in enumerate(prompts.values()):
        assert_close_rel(logits[i], hf_last_logits(hf, tokens))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 4096, 1], ids=["one_chunk", "chunks", "per_request"])
def test_decode_steps(tiny, page_size, chunk_bytes):
    folder, hf = tiny
    runner = make_runner(folder, page_size)
    runner.attn_backend.decode_chunk_bytes = chunk_bytes
    runner.attn_backend.min_padded_fill = 0.0 if chunk_bytes > 4096 else 0.5
    driver = ModelDriver(runner)
    prompts = _prompts(4)
    driver.extend(prompts)
    rng = random.Random(5)
    for step in range(6):
        # A request joins late and one leaves: the decode batch is ragged and changes.
        if step == 2:
            driver.extend({"late": [rng.randrange(256) for _ in range(11)]})
        if step == 4:
            driver.free("r1")
        next_tokens = {rid: rng.randrange(256) for rid in driver.reqs}
        logits = driver.decode(next_tokens)
        for i, rid in enumerate(next_tokens):
            assert_close_rel(logits[i], hf_last_logits(hf, driver.reqs[rid].tokens))


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_32_tokens_match_transformers(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    prompts = _prompts(6, [12, 3, 25])
    ours = {rid: [] for rid in prompts}
    next_ids = driver.extend(prompts).argmax(-1).tolist()
    for _ in range(32):
        for rid, tok in zip(prompts, next_ids):
            ours[rid].append(tok)
        next_ids = driver.decode(dict(zip(prompts, next_ids))).argmax(-1).tolist()
    hf.generation_config.eos_token_id = None  # never stop early: 32 tokens, like ours
    for rid, tokens in prompts.items():
        ids = torch.tensor([tokens])
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )[0, len(tokens) :].tolist()
        assert ours[rid] == ref, rid
