"""The bundled SmolLM2 GGUF: conversion cache, and greedy output equal to transformers loading the
same GGUF."""

from __future__ import annotations

from pathlib import Path

import torch
from model_utils import ModelDriver, make_runner

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
