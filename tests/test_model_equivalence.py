"""Our forward over the paged KV pool vs transformers on the same tiny random models (fp32).

Mistral, Gemma 2/3 and Phi-3 have sliding windows (8 or 12 tokens) shorter than the sequences,
Gemma 2 soft-caps its attention scores and logits, Phi-3 has a partial rotary embedding and
longrope whose long factors start past 20 tokens. As transformers picks longrope's factors per
forward, Phi-3's reference runs transformers over the same chunks (prefill chunks, decode steps)
with a KV cache; the others' reference is one forward over the whole sequence."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
WINDOWED = ["mistral", "gemma2", "gemma3", "phi3"]
LENGTHS = [37, 5, 18, 1]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    overrides = {"tie_word_embeddings": True} if request.param == "qwen2" else {}
    hf = save_tiny_model(request.param, folder, seed=ARCHS.index(request.param), **overrides)
    return folder, hf


def _reference(hf, req) -> torch.Tensor:
    """transformers' logits after the request's tokens (see the module docstring)."""
    longrope = (hf.config.rope_parameters or {}).get("rope_type") == "longrope"
    return hf_last_logits(hf, req.tokens, req.chunks if longrope else None)


def _prompts(seed: int, lengths=LENGTHS) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate(lengths)}


@pytest.mark.parametrize("page_size", [1, 16])
def test_full_prefill_ragged_batch(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    prompts = _prompts(1)
    logits = driver.extend(prompts)
    for i, rid in enumerate(prompts):
        assert_close_rel(logits[i], _reference(hf, driver.reqs[rid]))


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
    for i, rid in enumerate(prompts):
        assert driver.reqs[rid].tokens == prompts[rid]
        assert_close_rel(logits[i], _reference(hf, driver.reqs[rid]))


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
            assert_close_rel(logits[i], _reference(hf, driver.reqs[rid]))


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
        assert ours[rid] == _hf_greedy(hf, tokens, 32), rid


def _hf_greedy(hf, tokens: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens: `generate`; for longrope, a greedy loop over the model's
    forward with its KV cache, as the engine runs. (`generate` of Phi-3 drops its cache and
    recomputes the whole sequence with the long factors once a sequence grows past the original
    context; the engine, like SGLang and vLLM, keeps the keys it cached with the short ones.)"""
    if (hf.config.rope_parameters or {}).get("rope_type") != "longrope":
        ids = torch.tensor([tokens])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False, pad_token_id=0
        )
        return out[0, len(tokens) :].tolist()
    from transformers import DynamicCache

    cache, step, out = DynamicCache(config=hf.config), tokens, []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([step]), past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            step = out[-1:]
    return out


@pytest.mark.parametrize("arch", WINDOWED)
def test_sliding_window_matters_on_these_sequences(arch, tmp_path):
    """The windowed models' sequences are longer than their windows: without the window,
    transformers' logits move far beyond the tolerance above (so the tests above check it)."""
    hf = save_tiny_model(arch, tmp_path, seed=ARCHS.index(arch))
    tokens = _prompts(1)["r0"]
    unwindowed = type(hf)(copy.deepcopy(hf.config)).eval()
    unwindowed.config.sliding_window = 10_000
    for layer in unwindowed.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 10_000
    unwindowed.load_state_dict(hf.state_dict())
    ref = hf_last_logits(hf, tokens)
    err = (hf_last_logits(unwindowed, tokens) - ref).abs().max().item()
    assert err > 1e-2 * ref.abs().max().item()
