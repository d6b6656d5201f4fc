"""The bundled SmolLM2 GGUF: conversion cache, and greedy output equal to transformers loading the
same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_utils import llama3_rope_factors, write_llama_gguf
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

from radixengine.model_loader import get_tokenizer, resolve_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
NEW_TOKENS = 20


def test_conversion_is_cached(gguf_path):
    folder = Path(resolve_model_path(gguf_path))
    assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    assert resolve_model_path(gguf_path) == str(folder)  # the second call finds the cache


def test_greedy_chat_matches_transformers_gguf(gguf_path):
    from transformers import AutoModelForCausalLM

    tokenizer = get_tokenizer(gguf_path)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    ours = _our_greedy(gguf_path, prompts)

    path = Path(gguf_path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for tokens, got in zip(prompts, ours):
        ids = torch.tensor([tokens])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )[0, len(tokens) :].tolist()
        assert got[: len(ref)] == ref, (tokenizer.decode(got), tokenizer.decode(ref))


def _our_greedy(gguf_path: str, prompts: list[list[int]]) -> list[list[int]]:
    driver = ModelDriver(make_runner(gguf_path, max_total_tokens=2048))
    rids = [f"p{i}" for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    next_ids = driver.extend(dict(zip(rids, prompts))).argmax(-1).tolist()
    for _ in range(NEW_TOKENS):
        for out, tok in zip(outputs, next_ids):
            out.append(tok)
        next_ids = driver.decode(dict(zip(rids, next_ids))).argmax(-1).tolist()
    return outputs


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama3_rope_freqs_of_a_gguf_match_transformers(tmp_path, monkeypatch):
    """A Llama 3.1 GGUF carries its RoPE scaling only as the `rope_freqs` tensor; a prompt well
    past the original context must give transformers' logits and greedy tokens."""
    monkeypatch.setenv("RADIXENGINE_CACHE_DIR", str(tmp_path / "cache"))
    hf = save_tiny_model("llama", tmp_path / "hf", rope_parameters=LLAMA3_ROPE)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, rope_freqs=llama3_rope_factors(hf.config))
    tokens = [(7 * i + 3) % 256 for i in range(300)]
    driver = ModelDriver(make_runner(path))
    logits = driver.extend({"a": tokens})[0]
    assert_close_rel(logits, hf_last_logits(hf, tokens))

    ids = torch.tensor([tokens])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    got = [int(logits.argmax())]
    for _ in range(7):
        got.append(int(driver.decode({"a": got[-1]})[0].argmax()))
    assert got == ref[0, len(tokens) :].tolist()


def test_linear_rope_scaling_of_a_gguf_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXENGINE_CACHE_DIR", str(tmp_path / "cache"))
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    hf = save_tiny_model("llama", tmp_path / "hf", rope_parameters=rope)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, rope_scaling=("linear", 4.0))
    tokens = [(5 * i + 1) % 256 for i in range(200)]
    logits = ModelDriver(make_runner(path)).extend({"a": tokens})[0]
    assert_close_rel(logits, hf_last_logits(hf, tokens))


def test_unsupported_rope_scaling_of_a_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXENGINE_CACHE_DIR", str(tmp_path / "cache"))
    hf = save_tiny_model("llama", tmp_path / "hf")
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, rope_scaling=("yarn", 4.0))
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        resolve_model_path(str(path))
