"""The bundled SmolLM2 (its GGUF, decode through the block kernels) with a random rank-8 adapter:
one batch of the adapter's request and the base model's gives each transformers + peft's greedy
tokens (on the GGUF's dequantized weights)."""

from __future__ import annotations

from pathlib import Path

import torch
from lora_utils import peft_model, save_random_adapter
from model_utils import ModelDriver, make_runner

from radixengine.model_loader import get_tokenizer, resolve_model_path

NEW_TOKENS = 8


def test_smollm2_with_a_random_adapter_matches_peft(gguf_path, tmp_path):
    hf_folder = Path(resolve_model_path(gguf_path))
    adapter = save_random_adapter(hf_folder, tmp_path / "adapter", seed=7, r=8, std=0.05)
    tokenizer = get_tokenizer(gguf_path)
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)

    runner = make_runner(gguf_path, max_total_tokens=1024, lora_paths=[f"a={adapter}"], num_threads=2)
    (lora_id,) = runner.lora_manager.adapters
    driver = ModelDriver(runner, {"lora": lora_id})
    prompts = {"lora": prompt, "base": prompt}
    outputs = {rid: [] for rid in prompts}
    next_ids = driver.extend(prompts).argmax(-1).tolist()
    for _ in range(NEW_TOKENS):
        for rid, tok in zip(prompts, next_ids):
            outputs[rid].append(tok)
        next_ids = driver.decode(dict(zip(prompts, next_ids))).argmax(-1).tolist()

    model = peft_model(hf_folder, adapter)
    ref = _greedy(model, prompt)  # may stop at EOS before NEW_TOKENS
    assert outputs["lora"][: len(ref)] == ref, (tokenizer.decode(outputs["lora"]), tokenizer.decode(ref))
    with model.disable_adapter():
        ref = _greedy(model, prompt)
    assert outputs["base"][: len(ref)] == ref, (tokenizer.decode(outputs["base"]), tokenizer.decode(ref))
    assert outputs["lora"] != outputs["base"], "the adapter was meant to change the output"


@torch.no_grad()
def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    return out[0, len(prompt) :].tolist()
